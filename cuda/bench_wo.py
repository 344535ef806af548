"""The weight-only rows of ``python -m llmc.cuda.bench`` (``--only gemvwo`` runs them alone):
the CudaBackend's ops on ``PackedWeight``s (cuda/gemv_wo.cu, cuda/wo_dequant.cu) at the
Llama-3-8B shapes, beside the BF16 fused GEMVs of the same shapes (cuda/gemv.cu).

Layouts (``LAYOUTS``): int4_wo g128 (f16 scales + offsets), int8_wo (one f16 scale per
row), Q4_K-like (4-bit, g32, f32 scales + offsets) and, for lm_head, Q6_K-like (8-bit
storage, g16, f32 scales).

- ``wo T=<M> <layout> <op>``: the fused small-step ops, T = 1 and 8 token rows; GB/s of
  weight bytes (codes + scales + offsets; activations are < 0.3 MB) against the copy rate
  of the same run (target 85 % at T = 1 for int4 g128 and int8; those also without the
  kernels' L2 prefetch ahead, ``WoOps.wo_prefetch``; and ``(stages S)``: the ring kernels'
  most stages ``WoOps.wo_stages`` swept, ``STAGE_SWEEP`` at T = 1, 0 at T = 8, where 0 is
  the register-stream kernels the ring replaced), then per (T, layout) the
  layer sums, and ``8B decode projection``: 32 such layers plus a bf16 lm_head GEMV
  (1.05 GB) as tokens/s (attention, norms and host time excluded: an upper bound);
- ``wo lm_head T=1 q6_k``: linear on the 128256 x 4096 GGUF lm_head;
- ``wo linear M=<M> <layout> <op>``: linear for M = 16 .. 8192 (gemv passes of 8 rows up to
  ``WoOps.wo_gemv_passes``, else dequantize-then-cuBLAS: wo_dequant.cu in row chunks +
  torch.mm; where passes run, also the dequantize-then-cuBLAS time beside them) in TFLOP/s
  against the bf16 matmul ceiling, beside torch.mm on the bf16 weight (``bf16 cuBLAS``).

CUDA-graph replays cycling over enough weight copies (>= 256 MB per op) that L2 serves none.

``wo_gemm_rows`` (also ``--only gemmwo`` alone): the large-step plans of linear
(llmc.cuda.gemm_wo_ops) for M in ``GEMM_PLAN_TOKENS`` x the four 8B projections x int4 g128
and int8, ``wo gemm M=<M> <layout> <op> <plan>`` with plan mma (gemm_wo.cu), sm90
(gemm_wo_sm90.cu, sm_90 only) and dequant (dequantize-then-cuBLAS), each in TFLOP/s beside
``wo gemm M=<M> bf16 cuBLAS <op>`` (torch.mm on the bf16 weight of the same shape; the
``fraction`` column is against the 8192^3 matmul ceiling of the run): the rows that set
``WO_GEMM_TABLE``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from llmc.cuda.bench_gemv8 import SHAPES  # op -> (weight rows, K) of Llama-3-8B
from llmc.cuda.reference_wo import PackedWeight

DEV = torch.device("cuda")
BF16 = torch.bfloat16
LAYOUTS = {  # name -> (bits, group_size (0 = K), offsets, scale dtype, code_zero)
    "int4_g128": (4, 128, True, torch.float16, 0),
    "int8": (8, 0, False, torch.float16, 128),
    "q4_k": (4, 32, True, torch.float32, 0),
}
TOKENS = (1, 8)
STAGE_SWEEP = {1: (0, 2, 4, 8, 16), 8: (0,)}  # T -> WoOps.wo_stages beside the default
GEMM_TOKENS = (16, 32, 64, 128, 1024, 8192)
GEMM_PLAN_TOKENS = (16, 64, 256, 512, 1024, 8192)
GEMM_PLAN_LAYOUTS = ("int4_g128", "int8")
COPY_BYTES = 256 << 20  # weight bytes cycled per op, so that L2 (50 MB) serves none
LAYERS, LM_HEAD = 32, (128256, 4096)  # lm_head rows, K


def random_packed(rows: int, k: int, layout: tuple, g: torch.Generator) -> PackedWeight:
    """Random codes (every byte value), scales and offsets of a real quantizer's size."""
    bits, gs, offs, sdt, cz = layout
    gs = gs or k
    width = k // 2 if bits == 4 else k
    codes = torch.randint(0, 256, (rows, width), device=DEV, generator=g, dtype=torch.uint8)
    if bits == 8 and cz == 32:  # 6-bit codes (Q6_K) in bytes
        codes &= 63
    groups = (rows, k // gs)
    scales = ((0.5 + torch.rand(groups, device=DEV, generator=g)) / (8 * k**0.5)).to(sdt)
    offsets = (-scales.float() * 8).to(sdt) if offs else None
    return PackedWeight(codes, scales, offsets, bits, cz, gs)


def _copies(rows: int, k: int, layout: tuple | None, g: torch.Generator) -> list[Any]:
    per = rows * k * 2 if layout is None else None
    out: list[Any] = []
    while True:
        if layout is None:
            out.append((torch.randn(rows, k, device=DEV, generator=g) / k**0.5).to(BF16))
        else:
            out.append(random_packed(rows, k, layout, g))
        nbytes = per if per is not None else out[0].nbytes
        if len(out) >= max(2, math.ceil(COPY_BYTES / nbytes)):
            return out


def _nbytes(w: Any) -> int:
    return w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size()


def _ops(be: Any, m: int, g: torch.Generator) -> dict[str, Callable[[Any], Any]]:
    """op -> fn(weight) on static M-row inputs (PackedWeight or bf16 tensor alike)."""
    eps, h, inter = 1e-5, SHAPES["qkv"][1], SHAPES["down"][1]
    norm_w = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).to(BF16)
    res = torch.randn(m, h, device=DEV, generator=g).to(BF16)
    x_o = torch.randn(m, h, device=DEV, generator=g).to(BF16)
    x_d = torch.randn(m, inter, device=DEV, generator=g).to(BF16)
    qkv = torch.empty(m, SHAPES["qkv"][0], device=DEV, dtype=BF16)
    act = torch.empty(m, inter, device=DEV, dtype=BF16)
    return {
        "qkv": lambda w: be.norm_linear(res, norm_w, eps, w, out=qkv),
        "o_proj": lambda w: be.linear_residual_add(x_o, w, res),
        "gate_up": lambda w: be.norm_gate_up_silu(res, norm_w, eps, w, out=act),
        "down": lambda w: be.linear_residual_add(x_d, w, res),
    }


def wo_rows(
    be: Any,
    rows: list,
    mem_row: Callable,
    flops_row: Callable,
    graph_ms: Callable[[Callable[[], Any], int], float],
    cycle: Callable[[list[Callable[[], Any]]], Callable[[], Any]],
    tokens: tuple[int, ...] = TOKENS,
    gemm_tokens: tuple[int, ...] = GEMM_TOKENS,
    stage_sweep: dict[int, tuple[int, ...]] | None = None,
) -> None:
    """Append the rows of the module docstring; ``mem_row``, ``flops_row``, ``graph_ms``
    and ``cycle`` are llmc.cuda.bench's; ``stage_sweep`` replaces
    ``STAGE_SWEEP`` (``{}``: no ring rows, as scripts/wo_gemv_quick.py)."""
    sweep = STAGE_SWEEP if stage_sweep is None else stage_sweep
    g = torch.Generator(device=DEV).manual_seed(7)
    labels: dict[str, tuple | None] = {**LAYOUTS, "bf16": None}
    for m in tokens:
        fns = _ops(be, m, g)
        for label, layout in labels.items():
            total_ms, total_bytes = 0.0, 0
            for op, (r, k) in SHAPES.items():
                copies = _copies(r, k, layout, g)
                fn = fns[op]
                ms = graph_ms(cycle([lambda w=w, fn=fn: fn(w) for w in copies]), len(copies))
                nbytes = _nbytes(copies[0])
                target = 0.85 if m == 1 and label in ("int4_g128", "int8") else None
                mem_row(f"wo T={m} {label} {op}", f"{k}->{r}", nbytes, ms, target)
                rows[-1]["us"] = ms * 1000
                if target is not None and hasattr(be, "wo_prefetch"):  # the other choice
                    be.wo_prefetch = False
                    ms2 = graph_ms(cycle([lambda w=w, fn=fn: fn(w) for w in copies]), len(copies))
                    del be.wo_prefetch  # back to the class default
                    mem_row(f"wo T={m} {label} {op} (no L2 prefetch)", f"{k}->{r}", nbytes, ms2,
                            None)  # fmt: skip
                if layout is not None and hasattr(be, "wo_stages"):  # the ring's depth
                    for st in sweep.get(m, ()):
                        be.wo_stages = st
                        ms3 = graph_ms(
                            cycle([lambda w=w, fn=fn: fn(w) for w in copies]), len(copies)
                        )
                        del be.wo_stages  # back to the class default
                        mem_row(f"wo T={m} {label} {op} (stages {st})", f"{k}->{r}", nbytes, ms3,
                                None)  # fmt: skip
                total_ms += ms
                total_bytes += nbytes
            mem_row(f"wo T={m} {label} layer (sum of rows)", "4 GEMVs", total_bytes, total_ms, None)
            rows[-1]["us"] = total_ms * 1000
            if m == 1:  # 32 layers + a bf16 lm_head read at this layer's rate
                head_bytes = LM_HEAD[0] * LM_HEAD[1] * 2
                step_ms = LAYERS * total_ms + head_bytes / (total_bytes / total_ms)
                step_bytes = LAYERS * total_bytes + head_bytes
                mem_row(f"wo 8B decode projection {label}", "32 layers+lm_head", step_bytes,
                        step_ms, None)  # fmt: skip
                rows[-1]["tok_s"] = 1000.0 / step_ms
    head = _copies(*LM_HEAD, (8, 16, False, torch.float32, 32), g)
    x1 = torch.randn(1, LM_HEAD[1], device=DEV, generator=g).to(BF16)
    logits = torch.empty(1, LM_HEAD[0], device=DEV, dtype=torch.float32)
    ms = graph_ms(cycle([lambda w=w: be.linear(x1, w, out=logits) for w in head]), len(head))
    shape = f"{LM_HEAD[1]}->{LM_HEAD[0]}"
    mem_row("wo lm_head T=1 q6_k", shape, _nbytes(head[0]), ms, None)
    for op, (r, k) in SHAPES.items():
        dense = (torch.randn(r, k, device=DEV, generator=g) / k**0.5).to(BF16)
        packs = {name: random_packed(r, k, lay, g) for name, lay in LAYOUTS.items()}
        for m in gemm_tokens:
            x = torch.randn(m, k, device=DEV, generator=g).to(BF16)
            out = torch.empty(m, r, device=DEV, dtype=BF16)
            flops = 2 * m * r * k
            ms = graph_ms(lambda x=x, out=out, d=dense: torch.mm(x, d.t(), out=out), 3)
            flops_row(f"wo linear M={m} bf16 cuBLAS {op}", f"{m}x{k}->{r}", flops, ms, None)
            for name, w in packs.items():
                fn = lambda x=x, out=out, w=w: be.linear(x, w, out=out)  # noqa: E731
                flops_row(f"wo linear M={m} {name} {op}", f"{m}x{k}->{r}", flops,
                          graph_ms(fn, 3), None)  # fmt: skip
                passes = getattr(be, "wo_gemv_passes", None)  # CudaBackend's (WoOps)
                if passes and m <= 8 * max(passes):  # the other plan: dequantize-then-cuBLAS
                    be.wo_gemv_passes = (1, 1)
                    flops_row(f"wo linear M={m} {name} {op} (dequant+cuBLAS)", f"{m}x{k}->{r}",
                              flops, graph_ms(fn, 3), None)  # fmt: skip
                    del be.wo_gemv_passes  # back to the class default


def wo_gemm_rows(
    be: Any,
    flops_row: Callable,
    graph_ms: Callable[[Callable[[], Any], int], float],
    tokens: tuple[int, ...] = GEMM_PLAN_TOKENS,
) -> None:
    """Append the ``wo gemm`` rows of the module docstring (``flops_row`` and ``graph_ms``
    are llmc.cuda.bench's: CUDA-graph replays, so that the launches of dequantize-then-
    cuBLAS's chunks do not bound it as they do timed eagerly). The GEMV passes are off
    (``wo_gemv_passes`` (1, 1)) so that M = 16 reaches the large-step plans; both
    attributes are restored afterwards."""
    g = torch.Generator(device=DEV).manual_seed(11)
    sm90 = torch.cuda.get_device_capability(DEV) == (9, 0) if DEV.type == "cuda" else False
    plans = ("mma", "sm90", "dequant") if sm90 else ("mma", "dequant")
    be.wo_gemv_passes = (1, 1)
    try:
        for op, (r, k) in SHAPES.items():
            dense = (torch.randn(r, k, device=DEV, generator=g) / k**0.5).to(BF16)
            packs = {name: random_packed(r, k, LAYOUTS[name], g) for name in GEMM_PLAN_LAYOUTS}
            for m in tokens:
                x = torch.randn(m, k, device=DEV, generator=g).to(BF16)
                out = torch.empty(m, r, device=DEV, dtype=BF16)
                flops, shape = 2 * m * r * k, f"{m}x{k}->{r}"
                ms = graph_ms(lambda x=x, out=out, d=dense: torch.mm(x, d.t(), out=out), 3)
                flops_row(f"wo gemm M={m} bf16 cuBLAS {op}", shape, flops, ms, None)
                for name, w in packs.items():
                    for plan in plans:
                        be.wo_gemm = plan
                        fn = lambda x=x, out=out, w=w: be.linear(x, w, out=out)  # noqa: E731
                        flops_row(f"wo gemm M={m} {name} {op} {plan}", shape, flops,
                                  graph_ms(fn, 3), None)  # fmt: skip
            del dense, packs
    finally:
        for attr in ("wo_gemm", "wo_gemv_passes"):  # back to the class defaults
            if attr in vars(be):
                delattr(be, attr)
