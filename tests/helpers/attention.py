"""Paged-attention batches for the kernel tests (tests/cuda: GPU and emulated).

``paged_batch(decode_lens, prefill, bs, device)``: AttentionMetadata of decode sequences
(one query each, the given context lengths) then prefill chunks ``(q_len, seq_len)``, their
blocks scattered over a shuffled pool with a few spare blocks; returns (meta, pool blocks,
query tokens). Block tables are padded with -1 past each sequence's blocks.
``unused_blocks(meta, num_blocks)``: the spare blocks (never block 0: the reference reads it
for -1 padding), for tests that poison them.
``rope_tables(hd, max_pos)``: cos / sin [max_pos, hd // 2] float32 (CPU).
``rel_err(out, want)``: ||out - want|| / ||want|| in float64 (on the CPU), asserting out has
no NaN.
"""

from __future__ import annotations

import math

import torch

from llmc.cuda.backend import AttentionMetadata


def paged_batch(
    decode_lens: list[int],
    prefill: list[tuple[int, int]],
    bs: int,
    device: torch.device | str = "cpu",
    nblocks_extra: int = 3,
    generator: torch.Generator | None = None,
) -> tuple[AttentionMetadata, int, int]:
    """See the module docstring."""
    seqs = [(1, n) for n in decode_lens] + list(prefill)
    max_blocks = max(math.ceil(sl / bs) for _, sl in seqs)
    total_blocks = sum(math.ceil(sl / bs) for _, sl in seqs) + nblocks_extra
    perm = torch.randperm(total_blocks, generator=generator).tolist()
    tables = torch.full((len(seqs), max_blocks + 1), -1, dtype=torch.int32)
    k = 0
    for i, (_, sl) in enumerate(seqs):
        nb = math.ceil(sl / bs)
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
        num_decode_seqs=len(decode_lens),
        max_query_len=max(ql for ql, _ in seqs),
        max_seq_len=max(sl for _, sl in seqs),
    )
    return meta, total_blocks, cu[-1]


def unused_blocks(meta: AttentionMetadata, num_blocks: int) -> list[int]:
    """See the module docstring."""
    used = set(meta.block_tables.flatten().tolist()) | {0}
    return [b for b in range(num_blocks) if b not in used]


def rope_tables(hd: int, max_pos: int, theta: float = 10000.0) -> tuple[torch.Tensor, ...]:
    """See the module docstring."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return f.cos(), f.sin()


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    """See the module docstring."""
    assert not torch.isnan(out).any(), "NaN in kernel output"
    o, w = out.double().cpu(), want.double().cpu()
    return ((o - w).norm() / w.norm().clamp_min(1e-30)).item()
