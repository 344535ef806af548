"""``--peer hf``: the same workload through HuggingFace transformers ``generate``.

The peer runs the engine's own weights (unfused back to the HF layout; an fp8 engine's
projections dequantized, so the peer computes them in bf16, weight-only) in the engine's
dtype on the same device, as static batches of the same requests in the same order:
prompts left-padded to the longest in the batch, greedy, ``min_new_tokens =
max_new_tokens`` so EOS never ends a row early (lengths are exact, as in llmc's run).

Cache setting: the fastest that works — ``static`` (transformers compiles the decode step)
on CUDA when the run has at most two distinct batch shapes (each new shape recompiles),
else ``dynamic``; a static-cache failure on the warm-up batch falls back to dynamic.
Warm-up batches of each shape run first and are not measured.

Timing: a streamer records ``perf_counter`` each time generate hands over a step's tokens
(after its device→host copy), so token times mean what they mean in llmc's records. A
request's tokens end at its own output length even though its static batch runs on.
Arrivals: offline and concurrency mode, every request arrives at t=0; request_rate mode,
a batch starts when its last request has arrived and the previous batch finished.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmc.base.errors import ConfigError, UnsupportedError
from llmc.compiler.spec import ModelSpec
from llmc.runtime.bench.workload import WorkloadRequest
from llmc.runtime.records import RequestRecord

CACHE_SETTINGS = ("auto", "static", "dynamic")


def hf_state_dict(spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Engine tensors (fused, execution layout) → HF Llama/Qwen2 parameter names."""
    q, kv, i = spec.q_size, spec.kv_size, spec.intermediate_size
    sd = {"model.embed_tokens.weight": tensors["embed_tokens"]}
    for n in range(spec.num_layers):
        e, h = f"layers.{n}.", f"model.layers.{n}."
        wq, wk, wv = tensors[e + "qkv_proj"].split([q, kv, kv], dim=0)
        sd[h + "self_attn.q_proj.weight"] = wq
        sd[h + "self_attn.k_proj.weight"] = wk
        sd[h + "self_attn.v_proj.weight"] = wv
        if spec.qkv_bias:
            bq, bk, bv = tensors[e + "qkv_bias"].split([q, kv, kv], dim=0)
            sd[h + "self_attn.q_proj.bias"] = bq
            sd[h + "self_attn.k_proj.bias"] = bk
            sd[h + "self_attn.v_proj.bias"] = bv
        sd[h + "self_attn.o_proj.weight"] = tensors[e + "o_proj"]
        gate, up = tensors[e + "gate_up_proj"].split([i, i], dim=0)
        sd[h + "mlp.gate_proj.weight"] = gate
        sd[h + "mlp.up_proj.weight"] = up
        sd[h + "mlp.down_proj.weight"] = tensors[e + "down_proj"]
        sd[h + "input_layernorm.weight"] = tensors[e + "input_norm"]
        sd[h + "post_attention_layernorm.weight"] = tensors[e + "post_attn_norm"]
    sd["model.norm.weight"] = tensors["final_norm"]
    sd["lm_head.weight"] = tensors["embed_tokens" if spec.tie_word_embeddings else "lm_head"]
    return sd


def load_hf_model(engine: Any, device: torch.device) -> Any:
    """The engine's model as a transformers CausalLM on ``device`` in the engine's dtype."""
    try:
        import transformers
    except ImportError as e:
        raise UnsupportedError("--peer hf needs the transformers package") from e
    from llmc.compiler.weight_passes import TORCH_DTYPES, dequantize_engine_weights

    spec: ModelSpec = engine.spec
    dtype = TORCH_DTYPES[engine.limits.dtype]
    hf = dict(engine.manifest.get("hf_config") or {})
    model_type = hf.pop("model_type", None) or (
        "qwen2" if spec.architecture.startswith("Qwen2") else "llama"
    )
    for k in ("transformers_version", "torch_dtype", "dtype", "architectures"):
        hf.pop(k, None)
    cfg = transformers.AutoConfig.for_model(model_type, **hf)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # an fp8 or weight-only engine's projections as the values they stand for, in dtype
    tensors = dequantize_engine_weights(
        engine.load_weights(device), engine.limits.dtype, engine.layouts
    )
    missing, unexpected = model.load_state_dict(hf_state_dict(spec, tensors), strict=False)
    del tensors
    bad = [k for k in missing if not k.endswith("lm_head.weight")] + list(unexpected)
    if bad:
        raise ConfigError(f"engine weights do not map onto the HF model: {bad[:5]}")
    return model.eval()


class _TokenClock:
    """A transformers streamer that records when each step's tokens reach the host."""

    def __init__(self, sync: bool) -> None:
        self.times: list[float] = []
        self._prompt_seen = False
        self._sync = sync

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate hands over the prompt first
            self._prompt_seen = True
            return
        if self._sync:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class PeerRun:
    requests: list[RequestRecord]
    start: float
    end: float
    config: dict[str, Any]


def _batches(n: int, size: int) -> list[range]:
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def _shape(reqs: Sequence[WorkloadRequest], idx: range) -> tuple[int, int, int]:
    return (
        len(idx),
        max(len(reqs[i].prompt_token_ids or ()) for i in idx),
        max(reqs[i].output_tokens for i in idx),
    )


def _generate(
    model: Any, reqs: Sequence[WorkloadRequest], idx: range, cache: str, pad_id: int
) -> list[float]:
    """One static batch; returns the host time of each generated step."""
    from transformers import GenerationConfig

    dev = model.device
    rows = [list(reqs[i].prompt_token_ids or ()) for i in idx]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for n, r in enumerate(rows):
        ids[n, width - len(r) :] = torch.tensor(r)
        mask[n, width - len(r) :] = 1
    new = max(reqs[i].output_tokens for i in idx)
    gen = GenerationConfig(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=list(model.config.eos_token_id or [])
        if isinstance(model.config.eos_token_id, list)
        else model.config.eos_token_id,
        cache_implementation="static" if cache == "static" else None,
    )
    clock = _TokenClock(sync=dev.type == "cuda")
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            generation_config=gen,
            streamer=clock,
        )
    if len(clock.times) < new:
        raise ConfigError(f"peer hf: generate produced {len(clock.times)} steps, expected {new}")
    return clock.times


def run_peer(
    engine: Any,
    reqs: Sequence[WorkloadRequest],
    *,
    device: str | torch.device,
    batch_size: int,
    cache: str = "auto",
    arrival_offsets: Sequence[float] | None = None,
    log: Any = None,
) -> PeerRun:
    """Run ``reqs`` through transformers generate; one RequestRecord per request."""
    if cache not in CACHE_SETTINGS:
        raise ConfigError(f"peer cache {cache!r} is not one of {', '.join(CACHE_SETTINGS)}")
    if batch_size < 1:
        raise ConfigError(f"peer batch size must be >= 1, got {batch_size}")
    if any(r.prompt_token_ids is None for r in reqs):
        raise UnsupportedError("--peer hf needs token-id prompts (tokenize the dataset first)")
    dev = torch.device(device)
    model = load_hf_model(engine, dev)
    pad = engine.spec.bos_token_id if engine.spec.bos_token_id is not None else 0
    batches = _batches(len(reqs), batch_size)
    shapes = list(dict.fromkeys(_shape(reqs, b) for b in batches))
    if cache == "auto":
        cache = "static" if dev.type == "cuda" and len(shapes) <= 2 else "dynamic"
    say = log or (lambda msg: None)
    warm = [next(b for b in batches if _shape(reqs, b) == s) for s in shapes[:2]]
    for b in warm:  # compile / autotune outside the measured window
        say(f"peer hf: warm-up batch of {len(b)} ({cache} cache)")
        try:
            _generate(model, reqs, b, cache, pad)
        except Exception as e:
            if cache != "static":
                raise
            say(f"peer hf: static cache failed ({type(e).__name__}: {e}); using dynamic")
            cache = "dynamic"
            _generate(model, reqs, b, cache, pad)
    records: list[RequestRecord] = []
    start = time.perf_counter()
    prev_end = start
    for bn, b in enumerate(batches):
        arrivals = [start + (arrival_offsets[i] if arrival_offsets else 0.0) for i in b]
        while (wait := max(arrivals) - time.perf_counter()) > 0:
            time.sleep(wait)
        t_sched = time.perf_counter()
        times = _generate(model, reqs, b, cache, pad)
        prev_end = time.perf_counter()
        for i, arr in zip(b, arrivals, strict=True):
            w = reqs[i]
            tt = times[: w.output_tokens]
            records.append(
                RequestRecord(
                    request_id=i,
                    arrival_time=arr,
                    num_prompt_tokens=len(w.prompt_token_ids or ()),
                    scheduled_time=t_sched,
                    first_token_time=tt[0],
                    token_times=list(tt),
                    finish_time=tt[-1],
                    num_output_tokens=len(tt),
                    finish_reason="length",
                )
            )
        say(f"peer hf: batch {bn + 1}/{len(batches)} done")
    config = {
        "name": "hf",
        "engine": "transformers generate (static batches)",
        "batch_size": batch_size,
        "cache_implementation": cache,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "dtype": engine.limits.dtype,
        "num_batches": len(batches),
        "warmup_batches": len(warm),
    }
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return PeerRun(records, start, prev_end, config)
