"""Tensor parallelism's layout (no torch): which rows or columns of each engine tensor a rank
holds, the rank's own ModelSpec, the per-rank file names, and the checks of ``--tp_size``.

Megatron-style, as TensorRT-LLM and vLLM split a Llama-family decoder over ``N`` ranks:

- **column split** (``[out, in]`` rows divided): ``qkv_proj`` (and Qwen2's ``qkv_bias``) —
  rank ``r`` holds its ``num_heads / N`` q heads and its KV heads (``num_kv_heads / N`` of
  them; when ``num_kv_heads < N`` each KV head is replicated on the ``N / num_kv_heads``
  ranks whose q heads read it), fused again as ``q_r | k_r | v_r``; ``gate_up_proj`` —
  gate and up each split, fused again as ``gate_r | up_r``;
- **row split** (``in`` columns divided): ``o_proj`` (the rank's q heads) and
  ``down_proj`` (its slice of the MLP); their outputs are partial sums that the runtime
  all-reduces before the residual add. Llama and Qwen2 have no bias on these layers, so
  nothing is added once;
- **replicated**: ``embed_tokens``, ``lm_head`` (not vocab-parallel) and the norms.

A rank's tensors are exactly ``rank_spec(spec, N).tensor_shapes()``: the same model with
``num_heads / N`` heads, ``max(1, num_kv_heads / N)`` KV heads and ``intermediate_size / N``
MLP columns, so its memory plan, its tensor check and its forward are the tp_size-1 ones
on that spec (plus the all-reduce).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, UnsupportedError
from llmc.compiler.spec import ModelSpec

WEIGHTS_FILE = "weights.safetensors"
PLAN_FILE = "plan.json"
TP_QUANTIZATIONS = ("none",)
"""Weight quantizations a tp_size > 1 engine may have (fp8 and weight-only are refused)."""

SPLIT_RULE = (
    "megatron: qkv_proj/qkv_bias and gate_up_proj by output rows (q, k, v and gate, up each "
    "split; KV heads replicated when fewer than ranks), o_proj and down_proj by input "
    "columns (all-reduced), embed_tokens, lm_head and norms replicated"
)
Ranges = tuple[tuple[int, int], ...]
"""Half-open index ranges along one axis, concatenated in this order."""


@dataclass(frozen=True)
class Split:
    """How one engine tensor is cut for a rank: the ``ranges`` along ``axis``."""

    axis: int
    ranges: Ranges


def check_tp_size(tp_size: object) -> int:
    """``--tp_size``: a power of two ≥ 1 (ConfigError naming the value)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int):
        raise ConfigError(f"tp_size must be an integer, got {tp_size!r}")
    if tp_size < 1 or tp_size & (tp_size - 1):
        raise ConfigError(f"tp_size must be a power of two (1, 2, 4, 8 …), got {tp_size}")
    return tp_size


def check_tp(spec: ModelSpec, tp_size: int, quantization: str, kv_cache_dtype: str) -> None:
    """The model and the engine settings can be split over ``tp_size`` ranks; else a
    ConfigError (a shape) or UnsupportedError (a quantization) naming the numbers."""
    check_tp_size(tp_size)
    if tp_size == 1:
        return
    n, heads, kv, inter = tp_size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    if n > heads:
        raise ConfigError(
            f"tp_size {n} is larger than the model's num_attention_heads ({heads}): every "
            "rank needs at least one attention head"
        )
    if heads % n:
        raise ConfigError(
            f"num_attention_heads ({heads}) is not divisible by tp_size {n}; use a tp_size "
            f"dividing {heads}"
        )
    if kv % n and n % kv:
        raise ConfigError(
            f"num_key_value_heads ({kv}) and tp_size {n}: one must divide the other (the KV "
            "heads are split, or each replicated on tp_size / num_key_value_heads ranks)"
        )
    if inter % n:
        raise ConfigError(
            f"intermediate_size ({inter}) is not divisible by tp_size {n}; use a tp_size "
            f"dividing {inter}"
        )
    if quantization not in TP_QUANTIZATIONS:
        raise UnsupportedError(
            f"--quantization {quantization} with --tp_size {n} is not supported: tensor "
            "parallelism shards unquantized weights only (build with --quantization none, or "
            "--tp_size 1)"
        )
    if kv_cache_dtype != "auto":
        raise UnsupportedError(
            f"--kv_cache_dtype {kv_cache_dtype} with --tp_size {n} is not supported (the KV "
            "scales are calibrated per engine, not per rank); use --kv_cache_dtype auto or "
            "--tp_size 1"
        )


def rank_spec(spec: ModelSpec, tp_size: int) -> ModelSpec:
    """The model one rank computes: its heads, KV heads and MLP columns (``check_tp`` first)."""
    if tp_size == 1:
        return spec
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // tp_size,
        num_kv_heads=max(1, spec.num_kv_heads // tp_size),
        intermediate_size=spec.intermediate_size // tp_size,
    )


def kv_heads_of_rank(spec: ModelSpec, tp_size: int, rank: int) -> range:
    """The KV heads (of the whole model) rank ``rank`` holds: its share, or the one head its
    q heads read when the KV heads are fewer than the ranks."""
    kv = spec.num_kv_heads
    if kv >= tp_size:
        per = kv // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * kv // tp_size
    return range(head, head + 1)


def tensor_splits(spec: ModelSpec, tp_size: int, rank: int) -> dict[str, Split | None]:
    """Every engine tensor name (``spec.tensor_shapes()``) → its Split for ``rank``, or None
    when the rank holds it whole (replicated)."""
    check_rank(tp_size, rank)
    hd = spec.head_dim
    hq = spec.num_heads // tp_size
    q = (rank * hq * hd, (rank + 1) * hq * hd)
    kvh = kv_heads_of_rank(spec, tp_size, rank)
    k0, v0 = spec.q_size, spec.q_size + spec.kv_size
    k = (k0 + kvh.start * hd, k0 + kvh.stop * hd)
    v = (v0 + kvh.start * hd, v0 + kvh.stop * hd)
    i, ir = spec.intermediate_size, spec.intermediate_size // tp_size
    mlp = (rank * ir, (rank + 1) * ir)
    column_qkv = Split(0, (q, k, v))
    by_suffix = {
        "qkv_proj": column_qkv,
        "qkv_bias": column_qkv,
        "gate_up_proj": Split(0, (mlp, (i + mlp[0], i + mlp[1]))),
        "o_proj": Split(1, (q,)),
        "down_proj": Split(1, (mlp,)),
    }
    out: dict[str, Split | None] = {}
    for name in spec.tensor_shapes():
        suffix = name.rsplit(".", 1)[-1]
        out[name] = by_suffix.get(suffix) if tp_size > 1 else None
    return out


def weights_file(tp_size: int, rank: int) -> str:
    """The rank's weight file in the engine directory (``weights.safetensors`` at tp_size 1)."""
    return WEIGHTS_FILE if tp_size == 1 else f"weights.rank{rank}.safetensors"


def plan_file(tp_size: int, rank: int) -> str:
    """The rank's memory plan in the engine directory (``plan.json`` at tp_size 1)."""
    return PLAN_FILE if tp_size == 1 else f"plan.rank{rank}.json"


def check_rank(tp_size: int, rank: int) -> None:
    """``rank`` is one of the engine's ranks (ConfigError naming both)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ConfigError(
            f"rank {rank!r} is outside the engine's tp_size {tp_size} (0..{tp_size - 1})"
        )


def tp_section(spec: ModelSpec, tp_size: int, weights: bool = True) -> dict[str, Any]:
    """The manifest's ``tensor_parallel`` section: tp_size, how tensors are split, the
    rank's model, and each rank's files (``weights`` None for dummy weights, made at load)."""
    return {
        "tp_size": tp_size,
        "split": SPLIT_RULE if tp_size > 1 else "none",
        "rank_model": rank_spec(spec, tp_size).to_dict(),
        "ranks": [
            {
                "rank": r,
                "weights": weights_file(tp_size, r) if weights else None,
                "plan": plan_file(tp_size, r),
            }
            for r in range(tp_size)
        ],
    }
