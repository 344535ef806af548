"""sampling.cu's one-CTA-per-row kernel (``sample_kernel``) on the CPU, through the host
emulator (tests/helpers/cuda_emulator.py), against ``llmc.cuda.reference.sample``.

``sample_kernel`` runs the same code as the sm_90 cluster kernel with one CTA per row (the
radix selects, the exact integer masses, the Gumbel-max pass, the non-finite rows); what
only the GPU tests check is the cluster exchange and the shared-memory slices. Token ids
must be equal row for row: the rule has no order-dependent float sum (the host's expf /
logf against torch's CPU exp / log: equal on these inputs, as the GPU's are by
construction). Skipped where g++ is missing.
"""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_emulator import EmulatedFamily, emulator_missing
from helpers.sampling_cases import FILTERS, LOGIT_KINDS, sampling_batch
from llmc.cuda import reference as ref
from llmc.cuda.kernels import KernelConfig
from llmc.cuda.sampling_ops import SAMPLE_THREADS

pytestmark = [
    pytest.mark.skipif(emulator_missing(), reason="g++ not on PATH"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    fam = EmulatedFamily(
        "sampling", KernelConfig("float32", 16, 4, 2), {"sample_kernel": 16},
        tmp_path_factory.mktemp("sampling_emu"),
    )  # fmt: skip
    return fam["sample_kernel"]


def emulated_sample(kernel, logits: torch.Tensor, meta) -> torch.Tensor:
    s, v = logits.shape
    has_pen = meta.output_counts is not None
    counts = meta.output_counts if has_pen else torch.zeros(1, dtype=torch.int32)
    pmask = meta.prompt_mask.to(torch.uint8) if has_pen else torch.zeros(1, dtype=torch.uint8)
    out = torch.full((s,), -1, dtype=torch.int64)
    kernel(
        (s,), SAMPLE_THREADS, logits, v, meta.temperature, meta.top_k, meta.top_p, meta.min_p,
        meta.seeds, meta.offsets, meta.repetition_penalty, meta.presence_penalty,
        meta.frequency_penalty, counts, pmask, int(has_pen), int(meta.all_greedy), out,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("filters", FILTERS)
def test_every_filter_combination(kernel, filters):
    logits, meta = sampling_batch(12, 1000, filters, "cpu", seed=len(filters) * 31)
    assert torch.equal(emulated_sample(kernel, logits, meta), ref.sample(logits, meta))


@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("v", [3, 257, 4099])
def test_ties_masked_and_peaked_rows(kernel, kind, v):
    logits, meta = sampling_batch(6, v, "top_k+top_p+min_p", "cpu", seed=v, kind=kind)
    assert torch.equal(emulated_sample(kernel, logits, meta), ref.sample(logits, meta))


def test_non_finite_rows_take_their_first_maximum(kernel):
    logits, meta = sampling_batch(3, 300, "top_k+top_p", "cpu", seed=5)
    logits[0] = float("-inf")
    logits[1, [17, 40]] = float("inf")
    got = emulated_sample(kernel, logits, meta)
    assert got[:2].tolist() == [0, 17]
    assert torch.equal(got, ref.sample(logits, meta))


def test_all_greedy_batches_take_every_row_greedy(kernel):
    """all_greedy (the host's promise, and the cluster kernel's no-slice launch): every row
    is greedy whatever its temperature, as in the reference."""
    logits, meta = sampling_batch(5, 700, "top_k+top_p", "cpu", seed=8)
    meta.all_greedy = True
    got = emulated_sample(kernel, logits, meta)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(got, ref.sample(logits, meta))
