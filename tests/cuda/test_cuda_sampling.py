"""The sampling kernels (cuda/sampling.cu) against ``llmc.cuda.reference.sample``, on the GPU.

Token ids must be equal row for row (the reference's rule has no order-dependent float
sum; on the GPU torch's exp / log are the kernels' expf / logf): every filter combination,
penalties, greedy rows, vocabularies 128,256 / 49,152 / odd sizes, batches 1..256, ties,
-inf entries, fully masked rows; the cluster kernel, the one-CTA-per-row kernel, and the
fallback for vocabularies whose slices do not fit shared memory; seeded rows batch
invariant; inside a CUDA graph. The plain-greedy path reads a row as 16-byte vectors with
several loads in flight per thread (scalar loads when the row's base is not 16-byte
aligned): the token is the first maximum there too. The token buffer is poisoned (-1)
before each call. Run with ``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.sampling_cases import FILTERS, LOGIT_KINDS, sampling_batch
from llmc.cuda import reference as ref
from llmc.cuda.backend import SamplingMetadata

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def be():
    from llmc.cuda.cuda_backend import CudaBackend

    return CudaBackend(DEV)


@pytest.fixture(params=["cluster", "row"])
def each_kernel(request, be):
    """The backend on sample_cluster_kernel, then on sample_kernel (one CTA per row)."""
    be.cluster_sampling = request.param == "cluster"
    yield be
    be.cluster_sampling = True


def kernel_sample(be, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if be._tokens is not None:
        be._tokens.fill_(-1)  # poison: every row must be written
    return be.sample(logits, meta).clone()


def assert_same_tokens(be, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    got = kernel_sample(be, logits, meta)
    want = ref.sample(logits, meta)
    assert got.dtype == torch.int64
    bad = (got != want).nonzero().flatten().tolist()
    assert not bad, [(r, got[r].item(), want[r].item()) for r in bad[:8]]
    return got


@pytest.mark.parametrize("v", [128256, 49152, 1000, 49157, 3])
@pytest.mark.parametrize("filters", FILTERS)
def test_kernels_equal_reference(each_kernel, filters, v):
    logits, meta = sampling_batch(64 if v > 3 else 9, v, filters, DEV, seed=v + len(filters))
    assert_same_tokens(each_kernel, logits, meta)


@pytest.mark.parametrize("s", [1, 2, 9, 64, 130, 256])
@pytest.mark.parametrize("filters", ["temperature", "top_k+top_p", "top_p", "mixed"])
def test_batch_sizes(be, s, filters):
    logits, meta = sampling_batch(s, 128256, filters, DEV, seed=s)
    assert_same_tokens(be, logits, meta)


@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("v", [128256, 4099, 50001])
@pytest.mark.parametrize("filters", ["top_k+top_p+min_p", "top_p", "temperature", "greedy"])
def test_ties_masked_and_peaked_rows(each_kernel, kind, v, filters):
    logits, meta = sampling_batch(24, v, filters, DEV, seed=v % 97, kind=kind)
    assert_same_tokens(each_kernel, logits, meta)


def test_non_finite_rows_take_their_first_maximum(each_kernel):
    logits, meta = sampling_batch(4, 128256, "top_k+top_p", DEV, seed=3)
    logits[0] = float("-inf")
    logits[1, [17, 40]] = float("inf")
    got = assert_same_tokens(each_kernel, logits, meta)
    assert got[:2].tolist() == [0, 17]


def test_all_greedy_batches_take_every_row_greedy(each_kernel):
    logits, meta = sampling_batch(16, 128256, "top_k+top_p", DEV, seed=6)
    meta.all_greedy = True  # the cluster kernel then runs without shared-memory slices
    got = assert_same_tokens(each_kernel, logits, meta)
    assert torch.equal(got, logits.argmax(dim=-1))


def test_vocabulary_past_shared_memory_falls_back(be):
    """Slices over the shared-memory budget: one CTA per row, the same tokens."""
    v = 8 * (be._sample_smem // 4 + 64)
    logits, meta = sampling_batch(3, v, "top_k+top_p+min_p", DEV, seed=11)
    assert_same_tokens(be, logits, meta)


def test_seeded_rows_are_batch_invariant(be):
    """A row's token is the same alone, at another index, or beside other rows."""
    logits, meta = sampling_batch(64, 128256, "top_k+top_p+min_p", DEV, seed=21)
    batch = kernel_sample(be, logits, meta)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(DEV)
    shuffled = kernel_sample(be, logits[perm].contiguous(), _rows(meta, perm))
    assert torch.equal(shuffled, batch[perm])
    for r in (0, 13, 63):
        one = torch.tensor([r], device=DEV)
        assert kernel_sample(be, logits[r : r + 1], _rows(meta, one)).item() == batch[r].item()


def test_inside_a_cuda_graph(be):
    logits, meta = sampling_batch(32, 128256, "top_k+top_p", DEV, seed=4)
    want = assert_same_tokens(be, logits, meta)  # eager first: loads kernels, sets limits
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = be.sample(logits, meta)
    be._tokens.fill_(-1)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    logits.copy_(torch.randn_like(logits) * 3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref.sample(logits, meta))


def _rows(meta: SamplingMetadata, idx: torch.Tensor) -> SamplingMetadata:
    """``meta`` restricted to rows ``idx`` (in that order)."""
    fields = {}
    for name in meta.__dataclass_fields__:
        val = getattr(meta, name)
        fields[name] = val[idx].contiguous() if isinstance(val, torch.Tensor) else val
    return SamplingMetadata(**fields)


def greedy_meta(s: int) -> SamplingMetadata:
    z = torch.zeros(s, device=DEV)
    return SamplingMetadata(
        temperature=z.clone(),
        top_k=torch.zeros(s, dtype=torch.int32, device=DEV),
        top_p=torch.ones(s, device=DEV),
        min_p=z.clone(),
        seeds=torch.zeros(s, dtype=torch.int64, device=DEV),
        offsets=torch.zeros(s, dtype=torch.int64, device=DEV),
        repetition_penalty=torch.ones(s, device=DEV),
        presence_penalty=z.clone(),
        frequency_penalty=z.clone(),
        all_greedy=True,
    )


@pytest.mark.parametrize("v", [128256, 49152, 1000, 49157, 3])
@pytest.mark.parametrize("s", [1, 5, 64])
@pytest.mark.parametrize("misaligned", [False, True])
def test_plain_greedy_is_first_argmax(be, v, s, misaligned):
    g = torch.Generator(device=DEV).manual_seed(v * 131 + s)
    buf = torch.randn(s * v + 1, generator=g, device=DEV)
    logits = (buf[1:] if misaligned else buf[:-1]).view(s, v)
    # ties: copy each row's maximum to a few later and earlier places
    for r in range(s):
        row = logits[r]
        top = int(row.argmax())
        for j in {(top * 7 + 3) % v, (top + v // 2) % v, v - 1}:
            row[j] = row[top]
    got = be.sample(logits, greedy_meta(s)).clone()
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert torch.equal(got, ref.sample(logits, greedy_meta(s)))


def test_plain_greedy_all_negative_infinity_row(be):
    """A row of -inf only (a fully masked row) still yields index 0, as the reference does."""
    logits = torch.full((2, 4096), float("-inf"), device=DEV)
    logits[1, 17] = 0.0
    got = be.sample(logits, greedy_meta(2)).clone()
    assert got.tolist() == [0, 17]
    assert torch.equal(got, ref.sample(logits, greedy_meta(2)))
