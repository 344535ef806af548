"""FP8 rows of ``python -m llmc.cuda.bench`` (issue 12): the quantizing kernels, the fp8 KV
write and decode attention beside their BF16 twins, and the W8A8 GEMMs beside BF16 cuBLAS
(fp8-KV prefill: ``llmc.cuda.bench_prefill``).

- quantizing epilogues (rms_norm_fp8, add_rms_norm_fp8, silu_and_mul_fp8, quantize_fp8):
  GB/s (bytes read + written) against the copy ceiling;
- rope_kv with a bf16 and an fp8 cache (``rope_kv_rows``, the bench's rope section): GB/s;
- decode attention at 64 sequences x 4,096 context (GQA 32/8, hd 128), bf16 and fp8 KV,
  auto and forced split plans (``decode_64x4096``, called by the bench for its decode
  section; CUDA-graph replays): GB/s of KV read (+ q / out) against the copy ceiling,
  target 85 % (issue 12);
- linear_fp8 (torch._scaled_mm row-wise) beside torch.mm in bf16 at the Llama-3-8B shapes
  (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096) for M = 512,
  1024, 4096 rows: TFLOP/s against the bf16 matmul ceiling (fp8 may pass 100 %).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DEV = torch.device("cuda")
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
GEMM_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096)}
GEMM_SHAPES["down"] = (4096, 14336)


def fp8_rows(
    be: Any, time_ms: Callable, mem_row: Callable, flops_row: Callable, capability: tuple
) -> None:
    """Append every FP8 row (see the module docstring) through the bench's row makers."""
    from llmc.cuda.reference_fp8 import Fp8Rows

    t, h = 16384, 4096
    x = torch.randn(t, h, device=DEV).to(BF16)
    res = torch.randn(t, h, device=DEV).to(BF16)
    w = torch.randn(h, device=DEV).to(BF16)
    rows = Fp8Rows(torch.empty(t, h, dtype=E4M3, device=DEV), torch.empty(t, device=DEV))
    shape = f"{t}x{h} bf16->e4m3"
    nbytes = x.nbytes + rows.q.nbytes + rows.scale.nbytes
    ms = time_ms(lambda: be.rms_norm_fp8(x, w, 1e-5, rows))
    mem_row("rms_norm_fp8", shape, nbytes, ms, 0.8)
    ms = time_ms(lambda: be.add_rms_norm_fp8(x, res, w, 1e-5, rows))
    mem_row("add_rms_norm_fp8", shape, nbytes + 2 * res.nbytes, ms, 0.8)
    ms = time_ms(lambda: be.quantize_fp8(x, rows))
    mem_row("quantize_fp8 (o_proj input)", shape, nbytes, ms, 0.8)

    # 4,096 rows, and the FP8 128/128 row's ~500-row decode steps
    i = 14336
    for t in (4096, 512):
        gu = torch.randn(t, 2 * i, device=DEV).to(BF16)
        act = Fp8Rows(torch.empty(t, i, dtype=E4M3, device=DEV), torch.empty(t, device=DEV))
        shape, nbytes = f"{t}x{2 * i} bf16->e4m3", gu.nbytes + act.q.nbytes
        ms = time_ms(lambda gu=gu, act=act: be.silu_and_mul_fp8(gu, act))
        mem_row("silu_and_mul_fp8", shape, nbytes, ms, 0.8)

    if capability >= (8, 9):
        _gemms(be, time_ms, flops_row)


def decode_meta(batch: int, ctx: int, bs: int) -> Any:
    """Decode metadata: ``batch`` sequences of ``ctx`` keys on randomly permuted blocks."""
    from llmc.cuda.backend import AttentionMetadata

    nb_seq = ctx // bs
    tables = torch.randperm(batch * nb_seq, device=DEV).to(torch.int32).view(batch, nb_seq)
    return AttentionMetadata(
        positions=torch.full((batch,), ctx - 1, device=DEV),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEV),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV),
        block_tables=tables.contiguous(),
        num_decode_seqs=batch,
        max_query_len=1,
        max_seq_len=ctx,
    )


def rope_kv_rows(be: Any, time_ms: Callable, mem_row: Callable) -> None:
    """RoPE + KV write, 16384 tokens, GQA 32/8, hd 128: bf16 cache, then an fp8 cache."""
    t, nq, nkv, hd, bs = 16384, 32, 8, 128, 32
    qkv = torch.randn(t, (nq + 2 * nkv) * hd, device=DEV).to(BF16)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=DEV).float() / hd))
    f = torch.arange(8192, device=DEV).float()[:, None] * inv[None]
    cos, sin = f.cos().contiguous(), f.sin().contiguous()
    nblk = t // bs + 8
    slots = torch.randperm(nblk * bs, device=DEV)[:t]
    qo = torch.empty(t, nq, hd, device=DEV, dtype=BF16)
    for dtype, scales in ((BF16, (1.0, 1.0)), (E4M3, (0.5, 0.5))):
        kc = torch.empty(nblk, bs, nkv, hd, device=DEV, dtype=dtype)
        vc = torch.empty_like(kc)
        nbytes = qkv.nbytes + qo.nbytes + 2 * t * nkv * hd * kc.element_size()
        ms = time_ms(
            lambda kc=kc, vc=vc, s=scales: be.rope_and_cache_write(
                qkv, pos, cos, sin, kc, vc, slots, *s, out=qo
            )
        )
        label = "" if dtype == BF16 else " (fp8 cache)"
        shape = f"{t} tok 32/8x128 bf16" + ("" if dtype == BF16 else "->e4m3")
        mem_row(f"rope_kv_write{label}", shape, nbytes, ms, 0.8)


def decode_64x4096(be: Any, time_ms: Callable, mem_row: Callable) -> None:
    """64 x 4,096 decode, bf16 and fp8 KV, auto split plan (the issue's 85 % target) and
    forced ones. The bench passes ``graph_ms`` as ``time_ms`` (as to every row here): the
    runner replays decode steps from CUDA graphs, and an eagerly timed launch also counts
    the GPU's wait for the host's (~45 us of a 212-us fp8 call on the H100, 2026-12-07)."""
    batch, ctx, nq, nkv, hd, bs = 64, 4096, 32, 8, 128, 32
    meta = decode_meta(batch, ctx, bs)
    q = torch.randn(batch, nq, hd, device=DEV).to(BF16)
    out = torch.empty(batch, nq * hd, device=DEV, dtype=BF16)
    auto = be.num_splits(batch, nkv, ctx)
    for dtype, scales in ((BF16, (1.0, 1.0)), (E4M3, (0.05, 0.05))):
        kc = torch.randn(batch * (ctx // bs), bs, nkv, hd, device=DEV).to(dtype)
        vc = torch.randn_like(kc, dtype=torch.float32).to(dtype)
        nbytes = kc.nbytes + vc.nbytes + 2 * q.nbytes
        label = "bf16" if dtype == BF16 else "fp8"
        for splits in (None, 1, 2, 4, 8):
            be.force_splits = splits
            ms = time_ms(lambda kc=kc, vc=vc, s=scales: be.attention(q, kc, vc, meta, *s, out))
            plan = f"{auto} auto" if splits is None else str(splits)
            name = f"decode_attention {label} KV (splits={plan})"
            mem_row(name, f"{batch}x{ctx} 32/8x128", nbytes, ms, 0.85 if splits is None else None)
        be.force_splits = None


def _gemms(be: Any, time_ms: Callable, flops_row: Callable) -> None:
    from llmc.cuda.reference_fp8 import Fp8Rows, quantize_weight_fp8

    for m in (512, 1024, 4096):
        for name, (n, k) in GEMM_SHAPES.items():
            x = torch.randn(m, k, device=DEV).to(BF16)
            wb = (torch.randn(n, k, device=DEV) / k**0.5).to(BF16)
            wq, ws = quantize_weight_fp8(wb.float())
            xq = be.quantize_fp8(x, Fp8Rows(torch.empty(m, k, dtype=E4M3, device=DEV),
                                            torch.empty(m, device=DEV)))  # fmt: skip
            y = torch.empty(m, n, device=DEV, dtype=BF16)
            flops = 2.0 * m * n * k
            ms = time_ms(lambda x=x, wb=wb, y=y: torch.mm(x, wb.t(), out=y))
            flops_row(f"gemm {name} M={m} bf16 (torch.mm)", f"{k}->{n}", flops, ms, None)
            ms = time_ms(lambda xq=xq, wq=wq, ws=ws, y=y: be.linear_fp8(xq, wq, ws, None, BF16, y))
            flops_row(f"gemm {name} M={m} fp8 (linear_fp8)", f"{k}->{n}", flops, ms, None)
            del wb, wq, ws
