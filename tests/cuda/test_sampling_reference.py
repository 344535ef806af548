"""The reference sampling rule (``llmc.cuda.reference.apply_filters`` / ``sample``) on the CPU.

The kept set is checked against a brute-force reading of the rule written in its
docstring (integer masses, mass strictly above, ties, -inf entries); the samples against
the distribution they must follow: softmax over the kept set (chi-square over many
offsets of one seed, each filter), greedy at temperature 0, the max alone at a tiny top_p.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.sampling_cases import FILTERS, LOGIT_KINDS, sampling_batch
from llmc.cuda import reference as ref
from llmc.cuda.backend import SamplingMetadata


def _one_row_meta(n: int, **p) -> SamplingMetadata:
    f = lambda x, dt=torch.float32: torch.full((n,), x, dtype=dt)  # noqa: E731
    return SamplingMetadata(
        temperature=f(p.get("temperature", 1.0)),
        top_k=f(p.get("top_k", 0), torch.int32),
        top_p=f(p.get("top_p", 1.0)),
        min_p=f(p.get("min_p", 0.0)),
        seeds=f(p.get("seed", 7), torch.int64),
        offsets=torch.arange(n, dtype=torch.int64),
        repetition_penalty=f(1.0),
        presence_penalty=f(0.0),
        frequency_penalty=f(0.0),
    )


def _kept_brute_force(row: torch.Tensor, k: int, p: float, m: float) -> list[bool]:
    """The docstring's rule, one token at a time (O(V^2)); row: float32 [V]."""
    v = row.numel()
    vals = row.tolist()
    mx = max(vals)
    if not math.isfinite(mx):
        return [True] * v
    srt = sorted(vals, reverse=True)
    kth = srt[min(k, v) - 1] if k > 0 else srt[-1]
    e = torch.exp(row - row.max())  # float32, as the rule
    q = [int(math.floor(x * 2.0**32)) for x in e.tolist()]
    in_k = [x >= kth for x in vals]
    z = sum(qi for qi, ok in zip(q, in_k, strict=True) if ok)
    kept = []
    for i in range(v):
        if not in_k[i]:
            kept.append(False)
            continue
        if p < 1.0:
            if p <= 0.0:
                ok_p = vals[i] == mx
            else:
                above = sum(q[j] for j in range(v) if in_k[j] and vals[j] > vals[i])
                ok_p = float(above) < float(torch.tensor(p).double()) * float(z)
                # the max's ties always survive (their mass above is 0 < p * Z)
            if not ok_p:
                kept.append(False)
                continue
        kept.append(bool(e[i] >= torch.tensor(m)))
    return kept


@pytest.mark.parametrize("kind", LOGIT_KINDS)
@pytest.mark.parametrize("filters", ["top_k", "top_p", "min_p", "top_k+top_p+min_p"])
def test_kept_set_is_the_documented_rule(filters, kind):
    logits, meta = sampling_batch(10, 61, filters, "cpu", seed=len(kind) + 5, kind=kind)
    scaled = logits / meta.temperature[:, None]
    got = torch.isfinite(ref.apply_filters(scaled, meta)) | (scaled == float("-inf"))
    for r in range(10):
        want = _kept_brute_force(
            scaled[r], int(meta.top_k[r]), float(meta.top_p[r]), float(meta.min_p[r])
        )
        if not math.isfinite(scaled[r].max().item()):
            continue  # unfiltered rows: sample() takes their first maximum
        finite = torch.isfinite(scaled[r]).tolist()
        assert [g and f for g, f in zip(got[r].tolist(), finite, strict=True)] == [
            w and f for w, f in zip(want, finite, strict=True)
        ], r


def test_top_p_boundary_in_integer_masses():
    """e = (1, .5, .5): q = (2**32, 2**31, 2**31), Z = 2**33; at p = .5 the mass above the
    tied pair is exactly p * Z, so both go; just above .5 both stay (ties together)."""
    logits = torch.tensor([[0.0, -math.log(2.0), -math.log(2.0)]])
    assert torch.exp(logits - logits.max()).tolist()[0] == [1.0, 0.5, 0.5]

    def kept(p: float) -> list[bool]:
        return torch.isfinite(ref.apply_filters(logits, _one_row_meta(1, top_p=p)))[0].tolist()

    assert kept(0.5) == [True, False, False]
    assert kept(0.50001) == [True, True, True]
    assert kept(1e-9) == [True, False, False]


@pytest.mark.parametrize(
    "params,support",
    [
        ({}, None),
        ({"top_k": 3}, [0, 1, 5]),
        ({"top_p": 0.6}, [0, 5]),  # at T .7: mass before token 1 is .74
        ({"min_p": 0.2}, [0, 1, 5]),
        ({"top_k": 4, "top_p": 0.8, "min_p": 0.05}, [0, 5]),  # top-4 mass before 1: .81
    ],
)
def test_samples_follow_softmax_of_the_kept_set(params, support):
    """Offsets 0..N-1 of one seed: draws from softmax(l / T) over the kept tokens."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.2])
    n, temp = 40000, 0.7
    meta = _one_row_meta(n, temperature=temp, **params)
    ids = ref.sample(logits.expand(n, 8).contiguous(), meta)
    counts = torch.bincount(ids, minlength=8).double()
    kept = torch.isfinite(ref.apply_filters((logits / temp)[None], _one_row_meta(1, **params)))[0]
    if support is not None:
        assert kept.nonzero().flatten().tolist() == support
    assert counts[~kept].sum() == 0
    expect = torch.softmax((logits.double() / temp).masked_fill(~kept, -math.inf), 0)[kept] * n
    chi2 = float(((counts[kept] - expect) ** 2 / expect).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof, counts, expect)


@pytest.mark.parametrize("filters", FILTERS)
def test_temperature_zero_is_greedy(filters):
    logits, meta = sampling_batch(16, 300, filters, "cpu", seed=9)
    meta.temperature[::2] = 0.0
    got = ref.sample(logits, meta)
    pen = ref.apply_penalties(logits, meta)
    assert torch.equal(got[::2], pen[::2].argmax(dim=-1))


def test_tiny_top_p_is_the_max_for_every_seed():
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(1)) * 3
    n = 64
    meta = _one_row_meta(n, top_p=1e-7, temperature=1.3)
    meta.seeds = torch.arange(n, dtype=torch.int64) * 7919
    ids = ref.sample(logits.expand(n, 5000).contiguous(), meta)
    assert ids.tolist() == [int(logits.argmax())] * n


def test_all_masked_row_and_infinite_logit():
    logits = torch.full((3, 6), float("-inf"))
    logits[1, 4] = float("inf")
    logits[1, 5] = float("inf")
    logits[2, 3] = 0.0
    ids = ref.sample(logits, _one_row_meta(3, top_k=2, top_p=0.5, min_p=0.1))
    assert ids.tolist() == [0, 4, 3]
