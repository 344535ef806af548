"""Paged-attention batches for the GPU kernel tests (tests/cuda).

``paged_batch(decode_lens, prefill, bs, device)``: AttentionMetadata of decode sequences
(one query each, the given context lengths) then prefill chunks ``(q_len, seq_len)``, their
blocks scattered over a shuffled pool with a few spare blocks; returns (meta, pool blocks,
query tokens). Block tables are padded with -1 past each sequence's blocks.
``rel_err(out, want)``: ||out - want|| / ||want|| in float64, asserting out has no NaN.
"""

from __future__ import annotations

import math

import torch

from llmc.cuda.backend import AttentionMetadata


def paged_batch(
    decode_lens: list[int],
    prefill: list[tuple[int, int]],
    bs: int,
    device: torch.device,
    nblocks_extra: int = 3,
) -> tuple[AttentionMetadata, int, int]:
    """See the module docstring."""
    seqs = [(1, n) for n in decode_lens] + list(prefill)
    max_blocks = max(math.ceil(sl / bs) for _, sl in seqs)
    total_blocks = sum(math.ceil(sl / bs) for _, sl in seqs) + nblocks_extra
    perm = torch.randperm(total_blocks).tolist()
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


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    """See the module docstring."""
    assert not torch.isnan(out).any(), "NaN in kernel output"
    o, w = out.double(), want.double()
    return ((o - w).norm() / w.norm().clamp_min(1e-30)).item()
