"""Calibrated scales of an fp8 KV cache (``llmc calibrate``): run a text through the engine,
record per layer the largest |k| and |v| written to the cache, and store
``k_scale = amax_k / 448``, ``v_scale = amax_v / 448`` in the engine (ModelOpt's and
TensorRT-LLM's max calibration of the KV cache).

Why: e4m3 has 3 mantissa bits between 2^-6 and 448; with the default scale 1.0 a layer whose
values are small is stored mostly in subnormals (SmolLM2-135M's first layer: |v| <= 0.60,
43 % of its values below 2^-6) and loses most of its bits. Scaled by amax / 448, every
layer uses the whole normal range.

What is recorded (``KVRangeObserver``, wrapping the backend's ``rope_and_cache_write``): v as
written; for k, the norm of each NeoX rotation pair (k_i, k_{i+hd/2}), which bounds both
rotated elements at every position (the cache stores k after RoPE), so the scale does not
depend on the positions the text happened to cover. Rows with slot -1 (not written) are
skipped. The engine itself runs as built during calibration (scales of 1.0: only later
layers' inputs carry that layer's fp8 rounding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmc.base.errors import ConfigError, UsageError
from llmc.base.text import printable
from llmc.compiler.engine_update import replace_tensors
from llmc.compiler.quantization import KV_SCALE
from llmc.cuda.reference_fp8 import FP8_MAX
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import SamplingParams

MIN_AMAX = 1e-6
"""Floor of a recorded amax (a layer that wrote only zeros keeps a finite, tiny scale)."""


class KVRangeObserver:
    """A backend that is ``inner`` but records, per layer, max |v| and the max norm of k's
    rotation pairs of every row ``rope_and_cache_write`` writes to the cache."""

    def __init__(self, inner: Any, layer_of: dict[int, int], nq: int, nkv: int, hd: int) -> None:
        self._inner, self._layer_of = inner, layer_of
        self._nq, self._nkv, self._hd = nq, nkv, hd
        self.k_amax = [0.0] * len(layer_of)
        self.v_amax = [0.0] * len(layer_of)
        self.rows = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def rope_and_cache_write(self, qkv: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        k_cache, slot_mapping = args[3], args[5]
        i = self._layer_of[k_cache.data_ptr()]
        live = qkv[slot_mapping >= 0].float()
        if live.shape[0]:
            nq, nkv, hd = self._nq, self._nkv, self._hd
            k = live[:, nq * hd : (nq + nkv) * hd].reshape(-1, nkv, 2, hd // 2)
            v = live[:, (nq + nkv) * hd :]
            self.k_amax[i] = max(self.k_amax[i], k.pow(2).sum(dim=2).sqrt().max().item())
            self.v_amax[i] = max(self.v_amax[i], v.abs().max().item())
            if i == 0:
                self.rows += live.shape[0]
        return self._inner.rope_and_cache_write(qkv, *args, **kwargs)


@dataclass(frozen=True)
class CalibrationSettings:
    """``llmc calibrate``'s settings."""

    engine_dir: str
    text_file: str
    num_tokens: int = 8192
    """Tokens of the text to run (from its start), in windows of ``window`` tokens."""
    window: int = 512
    backend: str = "auto"
    device: str = "auto"


@dataclass
class CalibrationResult:
    engine_dir: str
    text_file: str
    tokens: int
    windows: int
    seconds: float
    scales: list[tuple[float, float]] = field(default_factory=list)
    """(k_scale, v_scale) per layer, as stored."""
    previous: list[tuple[float, float]] = field(default_factory=list)


def observe(rt: EngineRuntime, windows: list[list[int]]) -> KVRangeObserver:
    """Run each window as a prompt (one token generated) with the observer installed."""
    layers = rt.runner.layers
    spec = rt.runner.spec
    layer_of = {rt.runner.kv_cache.layer(i)[0].data_ptr(): i for i in range(spec.num_layers)}
    obs = KVRangeObserver(
        layers.backend, layer_of, spec.num_heads, spec.num_kv_heads, spec.head_dim
    )
    layers.backend = obs
    try:
        with rt.executor() as ex:
            outs = ex.generate(windows, [SamplingParams(max_new_tokens=1)] * len(windows))
    finally:
        layers.backend = obs._inner
    failed = [o.error for o in outs if not o.ok]
    if failed:
        raise ConfigError(f"calibration run failed: {failed[0]}")
    return obs


def calibrate_engine(settings: CalibrationSettings, text: str) -> CalibrationResult:
    """Measure the KV ranges of ``settings.engine_dir`` over ``text`` and store the scales."""
    config = RuntimeConfig(device=settings.device, backend=settings.backend, cuda_graphs=False)
    rt = EngineRuntime.load(settings.engine_dir, config)
    where = printable(settings.engine_dir)
    if rt.limits.kv_cache_dtype != "fp8":
        raise ConfigError(
            f"{where}: its KV cache is {rt.limits.kv_cache_dtype}, not fp8: only an fp8 KV "
            "cache has scales (build with --kv_cache_dtype fp8)"
        )
    if rt.tokenizer is None:
        raise UsageError(f"{where} has no tokenizer: calibration tokenizes the text with it")
    ids = rt.tokenizer.encode(text)[: settings.num_tokens]
    window = min(settings.window, rt.limits.max_input_len)
    windows = [ids[b : b + window] for b in range(0, len(ids), window)]
    if not windows:
        raise UsageError(f"--text_file {printable(settings.text_file)}: no tokens to run")
    t0 = time.perf_counter()
    obs = observe(rt, windows)
    seconds = time.perf_counter() - t0
    names = [f"layers.{i}.{KV_SCALE}" for i in range(rt.runner.spec.num_layers)]
    previous = [tuple(rt.runner.weights[n].tolist()) for n in names]
    scales = [
        (max(k, MIN_AMAX) / FP8_MAX, max(v, MIN_AMAX) / FP8_MAX)
        for k, v in zip(obs.k_amax, obs.v_amax, strict=True)
    ]
    engine_dir = rt.engine.dir
    del rt  # the weights are rewritten next: nothing of the old file stays mapped
    tensors = {n: torch.tensor(s, dtype=torch.float32) for n, s in zip(names, scales, strict=True)}
    record = {
        "kv_cache": {
            "method": "max", "text_file": Path(settings.text_file).name, "tokens": len(ids),
            "windows": len(windows),
        }
    }  # fmt: skip
    replace_tensors(engine_dir, tensors, record)
    return CalibrationResult(
        engine_dir=str(engine_dir), text_file=str(settings.text_file), tokens=len(ids),
        windows=len(windows), seconds=seconds,
        scales=[(float(k), float(v)) for k, v in (t.tolist() for t in tensors.values())],
        previous=[(float(k), float(v)) for k, v in previous],
    )  # fmt: skip
