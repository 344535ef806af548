"""The plain-greedy path of the sampling kernel (no penalties) against torch.argmax, on the GPU.

That path reads a row as 16-byte vectors with several loads in flight per thread (scalar
loads when the row's length or base is not 16-byte aligned). What must hold on every path:
the token is the argmax of the row and, among equal maxima, the first index
(``llmc.cuda.reference.sample``'s rule; ``torch.argmax`` returns the first maximum too).
Run with ``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

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
