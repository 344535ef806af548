"""The split decode kernel's partial buffers after a change of shape (``CudaBackend.reserve``).

``python -m llmc.cuda.bench --only decode`` ran the Llama-3-8B shape (32 q heads x 128) at
256 rows, then the SmolLM2-135M shape (9 x 64) at 1,024 rows, and the second launch wrote
past ``_part_ml`` and ``_counters`` (an illegal address on the H200, 2026-12-02): reserve
sized all three buffers from ``_part_acc`` alone, which was still large enough. Here the
same kind of change, small enough for any GPU, checked against the reference. Run with
``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import paged_batch, rel_err
from llmc.cuda import reference as ref

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

DEV = torch.device("cuda")


def _decode(be, nq: int, nkv: int, hd: int, lens: list[int]) -> float:
    meta, nblocks, _ = paged_batch(lens, [], 16, DEV)
    kc = torch.randn(nblocks, 16, nkv, hd, device=DEV).to(torch.bfloat16)
    vc = torch.randn(nblocks, 16, nkv, hd, device=DEV).to(torch.bfloat16)
    q = torch.randn(len(lens), nq, hd, device=DEV).to(torch.bfloat16)
    out = be.attention(q, kc, vc, meta)
    torch.cuda.synchronize()
    return rel_err(out, ref.paged_attention(q, kc, vc, meta))


def test_more_rows_of_a_smaller_head_dim_get_their_own_buffers():
    from llmc.cuda.cuda_backend import SPLIT_ROWS_PER_SEQ, CudaBackend

    torch.manual_seed(0)
    be = CudaBackend(DEV, max_num_seqs=8)
    be.cluster_decode = False  # the split kernel (paged_attention_kernel) at any batch
    be.force_splits, be.force_min_keys = 4, 32  # every row split: the partials are used
    assert _decode(be, 32, 8, 128, [700] * 8) < 1e-2
    # 48 rows x 9 heads x 64: _part_acc (8 x 32 x 128 a split row) is still large enough,
    # _part_ml and _counters (8 x 32 a split row) are not
    be.max_num_seqs = 48
    assert 48 * 9 * 64 <= 8 * 32 * 128 and 48 * 9 > 8 * 32
    assert _decode(be, 9, 3, 64, [700 + 7 * i for i in range(48)]) < 1e-2
    rows = 48 * SPLIT_ROWS_PER_SEQ * 9
    assert be._part_ml.numel() >= 2 * rows and be._counters.numel() >= rows
