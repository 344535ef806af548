"""Paged-attention inputs for the kernel tests (GPU and emulated alike).

- ``paged_batch``: AttentionMetadata of decode sequences (context lengths) then prefill
  chunks ((query_len, seq_len) pairs), each sequence on randomly permuted blocks, plus a few
  blocks no table refers to (tests poison them);
- ``unused_blocks``: those blocks (never block 0: the reference reads it for -1 padding);
- ``rope_tables``: cos / sin [max_pos, hd // 2] float32;
- ``rel_err``: ||out - want|| / ||want|| in float64, asserting out has no NaN.
"""

from __future__ import annotations

import math

import torch

from llmc.cuda.backend import AttentionMetadata


def paged_batch(
    decode: list[int],
    prefill: list[tuple[int, int]],
    bs: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    extra_blocks: int = 3,
) -> tuple[AttentionMetadata, int, int]:
    """(metadata, number of cache blocks, number of tokens)."""
    seqs = [(1, n) for n in decode] + list(prefill)
    blocks = [max(1, math.ceil(sl / bs)) for _, sl in seqs]
    total = sum(blocks) + extra_blocks
    perm = torch.randperm(total, generator=generator).tolist()
    tables = torch.full((len(seqs), max(blocks) + 1), -1, dtype=torch.int32)
    k = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor(perm[k : k + nb], dtype=torch.int32)
        k += nb
    cu = [0]
    for ql, _ in seqs:
        cu.append(cu[-1] + ql)
    meta = AttentionMetadata(
        positions=torch.zeros(cu[-1], dtype=torch.int64, device=device),
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([sl for _, sl in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decode_seqs=len(decode),
        max_query_len=max(ql for ql, _ in seqs),
        max_seq_len=max(sl for _, sl in seqs),
    )
    return meta, total, cu[-1]


def unused_blocks(meta: AttentionMetadata, num_blocks: int) -> list[int]:
    used = set(meta.block_tables.flatten().tolist()) | {0}
    return [b for b in range(num_blocks) if b not in used]


def rope_tables(hd: int, max_pos: int, theta: float = 10000.0) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return f.cos(), f.sin()


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    o, w = out.double().cpu(), want.double().cpu()
    return ((o - w).norm() / w.norm().clamp_min(1e-30)).item()
