"""Prefill-attention rows of ``python -m llmc.cuda.bench`` (called by ``llmc.cuda.bench.run``).

Each shape is timed on the Hopper kernel (prefill_attention_sm90.cu, where the backend
selects it) and on the mma.sync kernel (prefill_attention.cu, ``CudaBackend.sm90_prefill``
off), beside torch's SDPA on contiguous K/V for the issue's shape. Shapes: one 4,096-token
causal sequence at GQA 32/8 x 128 (bf16 KV and fp8 KV) and at SmolLM2's 9/3 x 64; a
2,048-token chunk after 4,096 cached tokens; a batch of 8 x 512-token prompts. TFLOP/s
count the causal products only (``llmc.cuda.prefill_sm90_ops.causal_flops``); targets
are fractions of the bf16 matmul ceiling (issue 12: >= 60 % on the 4,096-token shape).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmc.cuda.backend import AttentionMetadata
from llmc.cuda.prefill_sm90_ops import causal_flops

DEV = torch.device("cuda")
BF16 = torch.bfloat16
BS = 32  # tokens per block, as the 8B engines
SHAPES = (
    # (label, [(q_len, seq_len)], nq, nkv, hd, target of the sm90 row)
    ("4096 tok causal 32/8x128", [(4096, 4096)], 32, 8, 128, 0.6),
    ("4096 tok causal 9/3x64", [(4096, 4096)], 9, 3, 64, None),
    ("2048 chunk +4096 ctx 32/8x128", [(2048, 6144)], 32, 8, 128, None),
    ("8x512 tok causal 32/8x128", [(512, 512)] * 8, 32, 8, 128, None),
)


def batch(chunks: list[tuple[int, int]], nkv: int, hd: int) -> tuple[AttentionMetadata, Any]:
    """Metadata and random bf16 caches (blocks shuffled) for prefill chunks."""
    nbs = [-(-sl // BS) for _, sl in chunks]
    perm = torch.randperm(sum(nbs), device=DEV).to(torch.int32)
    tables = torch.zeros(len(chunks), max(nbs), dtype=torch.int32, device=DEV)
    k, cu = 0, [0]
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[k : k + nb]
        k += nb
        cu.append(cu[-1] + chunks[i][0])
    meta = AttentionMetadata(
        positions=torch.zeros(cu[-1], dtype=torch.int64, device=DEV),
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=DEV),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([sl for _, sl in chunks], dtype=torch.int32, device=DEV),
        block_tables=tables,
        num_decode_seqs=0,
        max_query_len=max(ql for ql, _ in chunks),
        max_seq_len=max(sl for _, sl in chunks),
    )
    kc = torch.randn(sum(nbs), BS, nkv, hd, device=DEV).to(BF16)
    return meta, (kc, torch.randn_like(kc, dtype=torch.float32).to(BF16))


def prefill_rows(be: Any, flops_row: Callable, time_ms: Callable) -> None:
    """Append the rows (``flops_row(name, shape, flops, ms, target)``)."""
    for label, chunks, nq, nkv, hd, target in SHAPES:
        meta, (kc, vc) = batch(chunks, nkv, hd)
        t = meta.cu_seqlens_q[-1].item()
        q = torch.randn(t, nq, hd, device=DEV).to(BF16)
        ao = torch.empty(t, nq * hd, device=DEV, dtype=BF16)
        flops = causal_flops([c[0] for c in chunks], [c[1] for c in chunks], nq, hd)
        kern = be.prefill_kernel(BF16, hd, BS)

        def run(q=q, kc=kc, vc=vc, meta=meta, ao=ao) -> Any:
            return be.attention(q, kc, vc, meta, out=ao)

        flops_row(f"prefill_attention({kern})", f"{label} bf16", flops, time_ms(run), target)
        if kern == "prefill_sm90":
            be.sm90_prefill = False
            flops_row("prefill_attention(mma.sync)", f"{label} bf16", flops, time_ms(run), None)
            be.sm90_prefill = True
            ks, vs = (c.float().abs().max().item() / 448.0 for c in (kc, vc))
            k8 = (kc.float() / ks).to(torch.float8_e4m3fn)
            v8 = (vc.float() / vs).to(torch.float8_e4m3fn)

            def run8(q=q, k8=k8, v8=v8, meta=meta, ao=ao, ks=ks, vs=vs) -> Any:
                return be._sm90.launch(q, k8, v8, meta, ao, k_scale=ks, v_scale=vs)

            flops_row("prefill_attention(sm90, fp8 KV)", f"{label}", flops, time_ms(run8), None)
        if len(chunks) == 1 and chunks[0][0] == chunks[0][1] and nq == 32:
            sdpa_row(q, kc, vc, flops, label, flops_row, time_ms)


def sdpa_row(q, kc, vc, flops, label, flops_row: Callable, time_ms: Callable) -> None:
    """torch SDPA on contiguous K/V (blocks in table order are not contiguous: gathered)."""
    t, _, hd = q.shape
    nkv = kc.shape[2]
    qs = q.transpose(0, 1)[None]
    ks = kc.reshape(-1, nkv, hd)[:t].transpose(0, 1)[None].contiguous()
    vs = vc.reshape(-1, nkv, hd)[:t].transpose(0, 1)[None].contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        ms = time_ms(lambda: sdpa(qs, ks, vs, is_causal=True, enable_gqa=True))
        flops_row("torch_sdpa (reference point)", f"{label}", flops, ms, None)
    except Exception as e:  # pragma: no cover - informational only
        print("sdpa comparison skipped:", e)
