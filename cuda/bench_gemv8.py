"""The FP8 GEMV rows of ``python -m llmc.cuda.bench``: the fused FP8 small-step GEMVs
(cuda/gemv_fp8.cu) at the Llama-3-8B shapes, T = 1 and 8 token rows, beside the BF16 fused
GEMV of the same shape (cuda/gemv.cu) and the unfused FP8 sequence the fused op replaces.

Per (T, op) three rows, GB/s of *weight* bytes (activations are < 0.3 MB) against the copy
rate measured in the same run:

- ``fp8 fused``: norm_linear_fp8 (qkv), linear_residual_add_fp8 (o_proj, down),
  norm_gate_up_silu_fp8 (gate_up); weights 1 byte each;
- ``fp8 unfused``: the CudaBackend's unfused FP8 ops for the same work (quantizing norm or
  quantize, linear_fp8, SiLU·mul / add + norm);
- ``bf16 fused``: norm_linear / linear_residual_add / norm_gate_up_silu on bf16 weights;

then per T the sums over the four ops (one decoder layer without attention). CUDA-graph
replays cycling over enough weight copies (>= 256 MB per op) that L2 serves none of them.
``python -m llmc.cuda.bench --only gemv8`` runs these rows alone (seconds of GPU time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from llmc.cuda import reference_fp8 as ref8

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
"""op -> (weight rows, K) of Llama-3-8B."""
TOKENS = (1, 8)
COPY_BYTES = 256 << 20  # weight bytes cycled per op, so that L2 (50 MB) serves none


def _copies(rows: int, k: int, dtype: torch.dtype, g: torch.Generator) -> list[Any]:
    """Random weights [rows, K] (fp8: with their per-row scales) in as many copies as fill
    COPY_BYTES."""
    itemsize = 1 if dtype == ref8.FP8_DTYPE else 2
    out = []
    for _ in range(max(2, math.ceil(COPY_BYTES / (rows * k * itemsize)))):
        w = (torch.randn(rows, k, device=DEV, generator=g) / k**0.5).to(BF16)
        out.append(ref8.quantize_weight_fp8(w) if itemsize == 1 else w)
    return out


def _ops(be: Any, m: int, g: torch.Generator) -> dict[str, dict[str, Callable[[Any], Any]]]:
    """op -> {label: fn(weight copy)} on static M-row inputs."""
    eps, nqkv, h, inter = 1e-5, SHAPES["qkv"][0], SHAPES["qkv"][1], SHAPES["down"][1]
    norm_w = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).to(BF16)
    res = torch.randn(m, h, device=DEV, generator=g).to(BF16)
    x_o = torch.randn(m, h, device=DEV, generator=g).to(BF16)
    x_d = torch.randn(m, inter, device=DEV, generator=g).to(BF16)
    a8, d8 = ref8.quantize_fp8(x_o), ref8.quantize_fp8(x_d)  # unfused GEMM inputs
    x8 = be.rms_norm_fp8(res, norm_w, eps)
    qkv = torch.empty(m, nqkv, device=DEV, dtype=BF16)
    gu = torch.empty(m, 2 * inter, device=DEV, dtype=BF16)
    act = torch.empty(m, inter, device=DEV, dtype=BF16)
    proj = torch.empty(m, h, device=DEV, dtype=BF16)

    def fp8_linear_add_norm(x: Any, w: Any) -> None:
        be.linear_fp8(x, w[0], w[1], None, BF16, out=proj)
        be.add_rms_norm_fp8(proj, res, norm_w, eps)

    def fp8_linear_silu(w: Any) -> None:
        be.linear_fp8(x8, w[0], w[1], None, BF16, out=gu)
        be.silu_and_mul_fp8(gu)

    return {
        "qkv": {
            "fp8 fused": lambda w: be.norm_linear_fp8(res, norm_w, eps, w[0], w[1], out=qkv),
            "fp8 unfused": lambda w: be.linear_fp8(
                be.rms_norm_fp8(res, norm_w, eps), w[0], w[1], None, BF16, out=qkv
            ),
            "bf16 fused": lambda w: be.norm_linear(res, norm_w, eps, w, out=qkv),
        },
        "o_proj": {
            "fp8 fused": lambda w: be.linear_residual_add_fp8(x_o, w[0], w[1], res),
            "fp8 unfused": lambda w: fp8_linear_add_norm(a8, w),
            "bf16 fused": lambda w: be.linear_residual_add(x_o, w, res),
        },
        "gate_up": {
            "fp8 fused": lambda w: be.norm_gate_up_silu_fp8(res, norm_w, eps, w[0], w[1], out=act),
            "fp8 unfused": fp8_linear_silu,
            "bf16 fused": lambda w: be.norm_gate_up_silu(res, norm_w, eps, w, out=act),
        },
        "down": {
            "fp8 fused": lambda w: be.linear_residual_add_fp8(x_d, w[0], w[1], res),
            "fp8 unfused": lambda w: fp8_linear_add_norm(d8, w),
            "bf16 fused": lambda w: be.linear_residual_add(x_d, w, res),
        },
    }


def fp8_gemv(
    be: Any,
    rows: list,
    mem_row: Callable,
    graph_ms: Callable[[Callable[[], Any], int], float],
    cycle: Callable[[list[Callable[[], Any]]], Callable[[], Any]],
    tokens: tuple[int, ...] = TOKENS,
) -> None:
    """Append the rows described in the module docstring; ``mem_row``, ``graph_ms`` and
    ``cycle`` are llmc.cuda.bench's (row maker, graph-replay timer, round-robin caller)."""
    g = torch.Generator(device=DEV).manual_seed(5)
    weights = {
        (op, label): _copies(r, k, ref8.FP8_DTYPE if label == "fp8" else BF16, g)
        for op, (r, k) in SHAPES.items()
        for label in ("fp8", "bf16")
    }
    for m in tokens:
        totals: dict[str, list[float]] = {}
        for op, fns in _ops(be, m, g).items():
            r, k = SHAPES[op]
            for label, fn in fns.items():
                copies = weights[(op, label.split()[0])]
                nbytes = r * k * (1 if label.startswith("fp8") else 2)
                try:
                    ms = graph_ms(cycle([lambda w=w, fn=fn: fn(w) for w in copies]), len(copies))
                except Exception as e:  # pragma: no cover - informational (an unsupported path)
                    print(f"gemv8 T={m} {op} {label} skipped: {type(e).__name__}: {e}")
                    continue
                target = 0.85 if label == "fp8 fused" and m == 1 else None
                mem_row(f"gemv8 T={m} {op} {label}", f"{k}->{r}", nbytes, ms, target)
                rows[-1]["us"] = ms * 1000
                t = totals.setdefault(label, [0.0, 0.0])
                t[0] += ms
                t[1] += nbytes
        for label, (ms, nbytes) in totals.items():
            mem_row(f"gemv8 T={m} layer ({label}, sum of rows)", "4 GEMVs", nbytes, ms, None)
            rows[-1]["us"] = ms * 1000
