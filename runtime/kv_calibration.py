"""Calibrated scales of an fp8 KV cache (``llmc calibrate``): run a text through the engine,
record per layer the largest |k| and |v| written to the cache, and store
``k_scale = amax_k / 448``, ``v_scale = amax_v / 448`` in the engine (ModelOpt's and
TensorRT-LLM's max calibration of the KV cache).

Why: e4m3 has 3 mantissa bits between 2^-6 and 448; with the default scale 1.0 a layer whose
values are small is stored mostly in subnormals (SmolLM2-135M's first layer: |v| <= 0.60,
43 % of its values below 2^-6) and loses most of its bits. Scaled by amax / 448, every
layer uses the whole normal range.

Smooth K (SageAttention; on by default, ``smooth_k``): post-RoPE k of a model such as
SmolLM2 carries a large per-channel mean (about half of its energy: RoPE's low-frequency
pairs barely turn, so their bias survives), and e4m3's relative rounding then spends its bits
on that constant. Calibration records, per layer, KV head and channel, the mean ``m`` of the
rotated k and stores it as ``layers.{i}.k_mean``; the cache holds ``k - m`` (softmax
cancels ``q.m``, the same for every key of a query) and ``k_scale = max |k - m| / 448``.

What is recorded (``KVRangeObserver``, wrapping the backend's ``rope_and_cache_write``): v as
written; for k without smoothing, the norm of each NeoX rotation pair (k_i, k_{i+hd/2}),
which bounds both rotated elements at every position (the cache stores k after RoPE), so the
scale does not depend on the positions the text happened to cover; with smoothing, the sum,
max and min of each channel of the rotated k (``k - m`` of positions the text did not cover
may exceed the observed range: e4m3 saturates there, as TensorRT-LLM's max calibration of
post-RoPE k does). Rows with slot -1 (not written) are skipped. The engine itself runs as
built during calibration (only later layers' inputs carry that layer's fp8 rounding; the
recorded k and v come from the projections, so a second calibration measures the same).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmc.base.errors import ConfigError, UsageError
from llmc.base.text import printable
from llmc.compiler.engine_update import replace_tensors
from llmc.compiler.quantization import K_MEAN, KV_SCALE
from llmc.cuda import reference as ref
from llmc.cuda.reference_fp8 import FP8_MAX
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import SamplingParams

MIN_AMAX = 1e-6
"""Floor of a recorded amax (a layer that wrote only zeros keeps a finite, tiny scale)."""


class KVRangeObserver:
    """A backend that is ``inner`` but records, per layer, max |v|, the max norm of k's
    rotation pairs, and per KV head and channel the sum, max and min of the rotated k of
    every row ``rope_and_cache_write`` writes to the cache."""

    def __init__(self, inner: Any, layer_of: dict[int, int], nq: int, nkv: int, hd: int) -> None:
        self._inner, self._layer_of = inner, layer_of
        self._nq, self._nkv, self._hd = nq, nkv, hd
        n = len(layer_of)
        self.k_amax = [0.0] * n
        self.v_amax = [0.0] * n
        self.k_sum = torch.zeros(n, nkv, hd, dtype=torch.float64)
        self.k_max = torch.full((n, nkv, hd), -math.inf)
        self.k_min = torch.full((n, nkv, hd), math.inf)
        self.layer_rows = [0] * n
        self.rows = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def rope_and_cache_write(self, qkv: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        positions, cos, sin, k_cache, _v, slot_mapping = args[:6]
        i = self._layer_of[k_cache.data_ptr()]
        keep = slot_mapping >= 0
        live = qkv[keep].float()
        if live.shape[0]:
            nq, nkv, hd = self._nq, self._nkv, self._hd
            k = live[:, nq * hd : (nq + nkv) * hd].reshape(-1, nkv, hd)
            v = live[:, (nq + nkv) * hd :]
            pairs = k.reshape(-1, nkv, 2, hd // 2)
            self.k_amax[i] = max(self.k_amax[i], pairs.pow(2).sum(dim=2).sqrt().max().item())
            self.v_amax[i] = max(self.v_amax[i], v.abs().max().item())
            pos = positions[keep]
            rot = ref.apply_rope(k, cos.index_select(0, pos), sin.index_select(0, pos)).cpu()
            self.k_sum[i] += rot.sum(0, dtype=torch.float64)
            torch.maximum(self.k_max[i], rot.amax(0), out=self.k_max[i])
            torch.minimum(self.k_min[i], rot.amin(0), out=self.k_min[i])
            self.layer_rows[i] += live.shape[0]
            if i == 0:
                self.rows += live.shape[0]
        return self._inner.rope_and_cache_write(qkv, *args, **kwargs)

    def k_mean(self, i: int) -> torch.Tensor:
        """Layer ``i``'s mean rotated k [nkv, hd] float32 (zeros where it wrote nothing)."""
        return (self.k_sum[i] / max(self.layer_rows[i], 1)).float()

    def smoothed_k_amax(self, i: int) -> float:
        """max |k - k_mean| over what layer ``i`` wrote (0.0 where it wrote nothing)."""
        if not self.layer_rows[i]:
            return 0.0
        m = self.k_mean(i)
        return max((self.k_max[i] - m).max().item(), (m - self.k_min[i]).max().item())


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
    smooth_k: bool = True
    """Store k's per-channel mean as ``k_mean`` and scale ``k - k_mean`` (off: a zero
    k_mean and the position-independent rotation-pair bound of k)."""


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
    smooth_k: bool = True
    k_amax_unsmoothed: list[float] = field(default_factory=list)
    """Per layer, max |k| over the text (the k range smoothing took away, beside ``scales``)."""


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
    nl = rt.runner.spec.num_layers
    names = [f"layers.{i}.{KV_SCALE}" for i in range(nl)]
    previous = [tuple(rt.runner.weights[n].tolist()) for n in names]
    k_amax = [obs.smoothed_k_amax(i) for i in range(nl)] if settings.smooth_k else obs.k_amax
    scales = [
        (max(k, MIN_AMAX) / FP8_MAX, max(v, MIN_AMAX) / FP8_MAX)
        for k, v in zip(k_amax, obs.v_amax, strict=True)
    ]
    unsmoothed = [
        max(obs.k_max[i].abs().max().item(), obs.k_min[i].abs().max().item()) for i in range(nl)
    ]
    engine_dir = rt.engine.dir
    del rt  # the weights are rewritten next: nothing of the old file stays mapped
    tensors = {n: torch.tensor(s, dtype=torch.float32) for n, s in zip(names, scales, strict=True)}
    for i in range(nl):
        mean = obs.k_mean(i) if settings.smooth_k else torch.zeros_like(obs.k_mean(i))
        tensors[f"layers.{i}.{K_MEAN}"] = mean
    record = {
        "kv_cache": {
            "method": "max", "text_file": Path(settings.text_file).name, "tokens": len(ids),
            "windows": len(windows), "smooth_k": settings.smooth_k,
        }
    }  # fmt: skip
    replace_tensors(engine_dir, tensors, record)
    return CalibrationResult(
        engine_dir=str(engine_dir), text_file=str(settings.text_file), tokens=len(ids),
        windows=len(windows), seconds=seconds,
        scales=[(float(k), float(v)) for k, v in (tensors[n].tolist() for n in names)],
        previous=[(float(k), float(v)) for k, v in previous], smooth_k=settings.smooth_k,
        k_amax_unsmoothed=unsmoothed,
    )  # fmt: skip
