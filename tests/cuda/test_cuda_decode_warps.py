"""decode_warp.cuh's kernels (one warp per (sequence, kv head, chunk)) on the GPU against
the torch reference: picked by ``CudaBackend.decode_kernel = "auto"`` for batches whose
(token, kv head) pairs fill the SMs, forced for small ones; bf16 / fp16 and e4m3 caches,
chunked sequences merged by the last warp (counters back to zero), mixed decode + prefill
batches, CUDA-graph replays with new lengths, unused blocks poisoned. Run with
``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import paged_batch, unused_blocks
from llmc.cuda import reference as ref

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

DEV = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
HEADS = ((128, 32, 8), (64, 9, 3), (16, 4, 2))


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    o, w = out.double(), want.double()
    return ((o - w).norm() / w.norm().clamp_min(1e-30)).item()


def backend(max_num_seqs: int, kernel: str = "auto"):
    from llmc.cuda.cuda_backend import CudaBackend

    be = CudaBackend(DEV, max_num_seqs=max_num_seqs)
    be.decode_kernel = kernel
    return be


def caches(meta, nblocks, bs, nkv, hd, dtype, fp8, scales):
    """K and V caches (bf16 / fp16 values or e4m3 codes of N(0, 1) / scale) with the unused
    blocks poisoned (NaN)."""
    out = []
    for s in scales:
        c = torch.randn(nblocks, bs, nkv, hd, device=DEV) / s
        c = c.clamp(-448, 448).to(E4M3) if fp8 else c.to(dtype)
        for b in unused_blocks(meta, nblocks):
            if fp8:
                c[b].view(torch.uint8).fill_(0x7F)
            else:
                c[b].fill_(float("nan"))
        out.append(c)
    return out


def lengths(n: int, seed: int) -> list[int]:
    """n decode contexts: mostly 100-300 keys, a few long ones (chunked), one of 1 key."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(100, 301, (n,), generator=g)
    lens[::37] = torch.randint(1500, 4100, (len(lens[::37]),), generator=g)
    lens[5] = 1
    return lens.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hd,nq,nkv", HEADS)
@pytest.mark.parametrize("fp8", [False, True])
def test_warps_kernel_large_batch(dtype, hd, nq, nkv, fp8):
    """A batch large enough for "auto" to pick the warp kernel: every row against the
    reference, three launches (counters reset)."""
    be = backend(512)
    if not be._lib(dtype, hd, nq, nkv).cfg.mma_decode(fp8):
        pytest.skip("no tensor-core decode pass for this config")
    n = max(1, -(-be._sm_count // nkv)) + 40
    assert be._warp_decode(be._lib(dtype, hd, nq, nkv), fp8, n, nkv)
    meta, nblocks, t = paged_batch(lengths(n, hd + fp8), [], 16, DEV)
    scales = (0.05, 0.02) if fp8 else (1.0, 1.0)
    kc, vc = caches(meta, nblocks, 16, nkv, hd, dtype, fp8, scales)
    for _ in range(3):
        q = (2 * torch.randn(t, nq, hd, device=DEV)).to(dtype)
        out = torch.full((t, nq * hd), float("nan"), dtype=dtype, device=DEV)
        be.attention(q, kc, vc, meta, *scales, out=out)
        assert rel_err(out, ref.paged_attention(q, kc, vc, meta, *scales)) < 1e-2
    assert int(be._counters.abs().sum()) == 0


@pytest.mark.parametrize("splits,min_keys", [(None, 1), (8, 1), (32, 32), (3, 100), (5, 4096)])
@pytest.mark.parametrize("bs", [16, 24])
@pytest.mark.parametrize("fp8", [False, True])
def test_warps_kernel_forced_chunks(splits, min_keys, bs, fp8):
    """Forced on a small batch: chunk counts chosen on the device from min_keys under the
    host's bound (forced splits), non-power-of-two blocks, repeated launches."""
    be = backend(16, "warps")
    be.force_splits, be.force_min_keys = splits, min_keys
    hd, nq, nkv, dtype = 128, 32, 8, torch.bfloat16
    meta, nblocks, t = paged_batch([1, 5, 31, 32, 33, 300, 1000, 2049], [], bs, DEV)
    scales = (0.1, 0.03) if fp8 else (1.0, 1.0)
    kc, vc = caches(meta, nblocks, bs, nkv, hd, dtype, fp8, scales)
    for _ in range(3):
        q = (2 * torch.randn(t, nq, hd, device=DEV)).to(dtype)
        out = torch.full((t, nq * hd), float("nan"), dtype=dtype, device=DEV)
        be.attention(q, kc, vc, meta, *scales, out=out)
        assert rel_err(out, ref.paged_attention(q, kc, vc, meta, *scales)) < 1e-2
    assert int(be._counters.abs().sum()) == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_warps_kernel_mixed_batch(fp8):
    """Decode rows on the warp kernel beside prefill chunks on the prefill kernel."""
    be = backend(512)
    hd, nq, nkv, dtype = 128, 32, 8, torch.bfloat16
    n = -(-be._sm_count // nkv) + 3
    meta, nblocks, t = paged_batch(lengths(n, 7), [(37, 37), (100, 260), (1, 50)], 16, DEV)
    scales = (0.05, 0.02) if fp8 else (1.0, 1.0)
    kc, vc = caches(meta, nblocks, 16, nkv, hd, dtype, fp8, scales)
    q = (2 * torch.randn(t, nq, hd, device=DEV)).to(dtype)
    out = torch.full((t, nq * hd), float("nan"), dtype=dtype, device=DEV)
    be.attention(q, kc, vc, meta, *scales, out=out)
    assert rel_err(out, ref.paged_attention(q, kc, vc, meta, *scales)) < 1e-2


@pytest.mark.parametrize("fp8", [False, True])
def test_warps_kernel_cuda_graph(fp8):
    """Captured once at the bucket's longest context, replayed on new lengths (some rows
    now chunked, one padding row of seq_len 0: zeros)."""
    be = backend(512)
    hd, nq, nkv, dtype = 128, 32, 8, torch.bfloat16
    n = -(-be._sm_count // nkv) + 5
    lens = lengths(n, 11)
    meta, nblocks, t = paged_batch(lens, [], 32, DEV)
    scales = (0.05, 0.02) if fp8 else (1.0, 1.0)
    kc, vc = caches(meta, nblocks, 32, nkv, hd, dtype, fp8, scales)
    q = torch.randn(t, nq, hd, device=DEV).to(dtype)
    out = torch.empty(t, nq * hd, dtype=dtype, device=DEV)
    meta.max_seq_len = 8192
    be.attention(q, kc, vc, meta, *scales, out=out)  # warm-up: kernels, buffers
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.attention(q, kc, vc, meta, *scales, out=out)
    for shrink in (1, 3):
        new = [max(1, x // shrink) for x in lens]
        new[-1] = 0
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        meta.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        meta.seq_lens[-1] = 1  # the reference needs a key; row -1 checked above
        want = ref.paged_attention(q, kc, vc, meta, *scales)
        assert rel_err(out[:-1], want[:-1]) < 1e-2
    assert int(be._counters.abs().sum()) == 0
