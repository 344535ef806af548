"""Small-batch decode attention on a thread-block cluster (sm_90+) against the reference.

``paged_attention_cluster_kernel`` splits each (token, kv head) over a cluster of CTAs and
merges the partial softmax states through distributed shared memory. Checked here: every
dtype and head shape, contexts from 1 key (one CTA has keys, seven are empty) to 4096,
power-of-two and other block sizes, graph-padding rows (seq_len 0 → zeros), CUDA-graph
capture with replays at other lengths, and that CudaBackend picks the cluster kernel only
for batches that fit one wave. Run with ``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmc.cuda import reference as ref
from llmc.cuda.backend import AttentionMetadata

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")
if torch.cuda.get_device_capability()[0] < 9:  # pragma: no cover
    pytest.skip("thread-block clusters need sm_90+", allow_module_level=True)

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
HEADS = ((128, 32, 8), (64, 9, 3), (16, 4, 2), (128, 32, 2))
"""(head_dim, nq, nkv): G = 4, 3, 2 and 16 (4 warps per CTA: KernelConfig.cluster_warps)."""


@pytest.fixture()
def be():
    from llmc.cuda.cuda_backend import CudaBackend

    b = CudaBackend(DEV, max_num_seqs=16)
    assert b.cluster_decode, "sm_90+: the cluster kernel must be on by default"
    return b


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    o, w = out.double(), want.double()
    return ((o - w).norm() / w.norm().clamp_min(1e-30)).item()


def decode_batch(lens: list[int], bs: int) -> tuple[AttentionMetadata, int]:
    blocks = [max(1, math.ceil(n / bs)) for n in lens]
    perm = torch.randperm(sum(blocks) + 2).tolist()
    tables = torch.full((len(lens), max(blocks) + 1), -1, dtype=torch.int32)
    k = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor(perm[k : k + nb], dtype=torch.int32)
        k += nb
    n = len(lens)
    meta = AttentionMetadata(
        positions=torch.zeros(n, dtype=torch.int64, device=DEV),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=DEV),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_tables=tables.to(DEV),
        num_decode_seqs=n,
        max_query_len=1,
        max_seq_len=max(lens),
    )
    return meta, sum(blocks) + 2


def run(be, dtype, hd, nq, nkv, lens, bs, padded=()):
    meta, nblocks = decode_batch(lens, bs)
    kc = torch.randn(nblocks, bs, nkv, hd, device=DEV).to(dtype)
    vc = torch.randn(nblocks, bs, nkv, hd, device=DEV).to(dtype)
    q = (2 * torch.randn(len(lens), nq, hd, device=DEV)).to(dtype)
    assert be.cluster_decode_ok(len(lens), nkv)
    out = torch.full((len(lens), nq * hd), float("nan"), dtype=dtype, device=DEV)
    want = ref.paged_attention(q, kc, vc, meta)
    if padded:
        lens2 = [0 if i in padded else n for i, n in enumerate(lens)]
        meta.seq_lens.copy_(torch.tensor(lens2, dtype=torch.int32))
    be.attention(q, kc, vc, meta, out=out)
    live = [i for i in range(len(lens)) if i not in padded]
    assert rel_err(out[live], want[live]) < TOL[dtype]
    for i in padded:
        assert torch.count_nonzero(out[i]) == 0, "a padding row must be zeros"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("hd,nq,nkv", HEADS)
@pytest.mark.parametrize("lens", ([1], [7], [384], [4096], [1, 33, 300, 1025]))
def test_cluster_decode_matches_reference(be, dtype, hd, nq, nkv, lens):
    if dtype == torch.float16 and hd != 128:
        pytest.skip("float16 checked at head_dim 128 (same code as bfloat16)")
    run(be, dtype, hd, nq, nkv, lens, 32)


@pytest.mark.parametrize("bs", [16, 24])
@pytest.mark.parametrize("min_keys", [1, 32, 5000])
def test_cluster_decode_block_sizes_and_split_counts(be, bs, min_keys):
    """Non-power-of-two blocks; every CTA busy (min_keys 1) or one CTA only (5000)."""
    be.force_min_keys = min_keys
    run(be, torch.bfloat16, 128, 32, 8, [3, 100, 2049], bs)


def test_cluster_decode_padding_rows_are_zero(be):
    run(be, torch.bfloat16, 128, 32, 8, [40, 300, 9], 32, padded=(1,))


def test_cluster_decode_only_for_one_wave(be):
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert be.cluster_decode_ok(1, 8)
    assert not be.cluster_decode_ok(sms, 8)  # a large batch fills the chip without splits
    be.cluster_decode = False
    assert not be.cluster_decode_ok(1, 8)


def test_cluster_decode_cuda_graph_replays(be):
    """Captured once for the bucket's longest context, replayed at other lengths."""
    hd, nq, nkv, bs, dtype = 128, 32, 8, 16, torch.bfloat16
    meta, nblocks = decode_batch([2000, 2000], bs)
    kc = torch.randn(nblocks, bs, nkv, hd, device=DEV).to(dtype)
    vc = torch.randn(nblocks, bs, nkv, hd, device=DEV).to(dtype)
    q = torch.randn(2, nq, hd, device=DEV).to(dtype)
    out = torch.empty(2, nq * hd, dtype=dtype, device=DEV)
    meta.max_seq_len = 4096
    be.attention(q, kc, vc, meta, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.attention(q, kc, vc, meta, out=out)
    for lens in ([1, 2000], [513, 64], [2000, 1999]):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref.paged_attention(q, kc, vc, meta)) < 1e-2
