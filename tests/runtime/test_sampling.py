"""Sampling: filters and penalties vs transformers' logits processors, the seeded RNG's
batch independence and distribution, and the metadata built from sequences."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import logits_process as hf

from llmc.cuda import reference as ref
from llmc.runtime import sampling as smp
from llmc.runtime.types import SamplingParams, Sequence

NINF = float("-inf")


def _seq(rid=0, prompt=(5, 6, 7), outputs=(), **params) -> Sequence:
    s = Sequence(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(**params),
        max_new_tokens=16,
        arrival_time=0.0,
    )
    s.output_token_ids = list(outputs)
    return s


def _meta(rows: list[dict], vocab: int, outputs=None, prompts=None):
    seqs = [
        _seq(i, prompt=(prompts or {}).get(i, (1,)), outputs=(outputs or {}).get(i, ()), **p)
        for i, p in enumerate(rows)
    ]
    return smp.metadata_for(seqs, vocab)


def _random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _assert_filter_matches_hf(name: str, value, warper, rows: int, seed: int) -> None:
    """apply_filters with ``name=value`` on every row equals HF's ``warper`` (None: a no-op)."""
    logits = _random_logits(rows, 256, seed)
    meta = _meta([{"temperature": 1.0, name: value}] * rows, 256)
    expect = logits if warper is None else warper(**{name: value})(None, logits.clone())
    assert torch.equal(ref.apply_filters(logits, meta), expect)


@pytest.mark.parametrize("k", [1, 2, 17, 255, 256, 1000])
def test_top_k_matches_hf(k):
    _assert_filter_matches_hf("top_k", k, hf.TopKLogitsWarper, rows=3, seed=0)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.99, 1.0])
def test_top_p_matches_hf(p):
    _assert_filter_matches_hf("top_p", p, hf.TopPLogitsWarper, rows=4, seed=1)


@pytest.mark.parametrize("m", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(m):
    warper = hf.MinPLogitsWarper if m > 0 else None  # min_p=0: the logits come back as they are
    _assert_filter_matches_hf("min_p", m, warper, rows=4, seed=2)


def test_filter_chain_matches_hf_per_row():
    """Rows with different parameters in one batch, each equal to HF's warper chain."""
    logits = _random_logits(4, 128, 3)
    rows = [
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
        {"temperature": 1.5, "top_k": 0, "top_p": 0.6},
        {"temperature": 1.0, "top_k": 5, "min_p": 0.3},
        {"temperature": 0.3},
    ]
    meta = _meta(rows, 128)
    got = ref.process_logits(logits, meta)
    for i, r in enumerate(rows):
        x = logits[i : i + 1].clone()
        x = hf.TemperatureLogitsWarper(r["temperature"])(None, x)
        if r.get("top_k"):
            x = hf.TopKLogitsWarper(r["top_k"])(None, x)
        if r.get("top_p", 1.0) < 1.0:
            x = hf.TopPLogitsWarper(r["top_p"])(None, x)
        if r.get("min_p"):
            x = hf.MinPLogitsWarper(r["min_p"])(None, x)
        torch.testing.assert_close(got[i], x[0], rtol=1e-6, atol=0)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(x[0]))


def test_filters_on_hand_made_distributions():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()

    def kept(**p) -> list[int]:
        out = ref.apply_filters(logits, _meta([{"temperature": 1.0, **p}], 4))
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.75) == [0, 1]
    assert kept(top_p=0.85) == [0, 1, 2]
    assert kept(top_p=0.4) == [0]
    assert kept(min_p=0.5) == [0, 1]  # p >= 0.25
    assert kept(min_p=0.2) == [0, 1, 2]  # p >= 0.1
    # top-p sees the renormalised top-3 (.526, .316, .158): the mass before token 2 is .842
    assert kept(top_p=0.82) == [0, 1, 2]
    assert kept(top_k=3, top_p=0.82) == [0, 1]
    tied = torch.tensor([[2.0, 1.0, 2.0, 0.0]])
    out = ref.apply_filters(tied, _meta([{"temperature": 1.0, "top_k": 1}], 4))
    assert torch.isfinite(out[0]).tolist() == [True, False, True, False]  # ties kept


def test_repetition_penalty_matches_hf_and_openai_penalties():
    vocab = 32
    logits = _random_logits(2, vocab, 4)
    prompts = {0: (3, 4, 4, 9), 1: (1, 2)}
    outputs = {0: (9, 11, 11, 11), 1: (5,)}
    rows = [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 0.8},
    ]
    meta = _meta(rows, vocab, outputs=outputs, prompts=prompts)
    got = ref.apply_penalties(logits, meta)
    seen0 = torch.tensor([list(prompts[0]) + list(outputs[0])])
    expect0 = hf.RepetitionPenaltyLogitsProcessor(1.3)(seen0, logits[:1].clone())[0]
    assert torch.equal(got[0], expect0)
    seen1 = torch.tensor([list(prompts[1]) + list(outputs[1])])
    expect1 = hf.RepetitionPenaltyLogitsProcessor(0.8)(seen1, logits[1:].clone())[0]
    expect1[5] -= 0.5 + 0.25  # presence + frequency * 1, output tokens only
    assert torch.equal(got[1], expect1)
    assert meta.output_counts[0, 11] == 3 and meta.prompt_mask[0, 4]
    assert not meta.prompt_mask[1, 5] and meta.output_counts[1, 5] == 1


def test_no_penalty_tensors_when_no_row_needs_them():
    meta = _meta([{"temperature": 0.5}, {}], 16, outputs={0: (1, 2)})
    assert meta.output_counts is None and meta.prompt_mask is None
    meta = _meta([{"temperature": 0.5}, {"frequency_penalty": 0.1}], 16, outputs={0: (1, 2)})
    assert meta.output_counts[0].sum() == 0  # rows without penalties keep zero counts


def test_greedy_is_first_argmax_after_penalties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 1.9, 0.0, 0.0]])
    meta = _meta([{}, {"repetition_penalty": 2.0}], 4, outputs={1: (0,)}, prompts={1: (3,)})
    assert meta.all_greedy
    assert ref.sample(logits, meta).tolist() == [1, 1]


def test_seeded_rows_are_batch_independent():
    vocab = 200
    logits = _random_logits(4, vocab, 5)
    rows = [
        {"temperature": 0.8, "seed": 42, "top_p": 0.9},
        {},
        {"temperature": 1.2, "top_k": 10},
        {"temperature": 0.8, "seed": 42, "top_p": 0.9},
    ]
    meta = _meta(rows, vocab, outputs={0: (1, 2, 3), 3: (7,)})
    batch = ref.sample(logits, meta)
    for i in (0, 2, 3):
        alone = ref.sample(
            logits[i : i + 1], _meta([rows[i]], vocab, outputs={0: (1,) * [3, 0, 0, 1][i]})
        )
        assert alone.item() == batch[i].item()
    assert batch[1].item() == logits[1].argmax().item()


def test_seeded_samples_follow_softmax():
    """Tokens at offsets 0..N-1 of one seed are draws from softmax(logits / T)."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.2])
    n, temp = 20000, 0.7
    meta = _meta([{"temperature": temp, "seed": 7}], 8)
    meta.seeds = meta.seeds.expand(n).contiguous()
    for name in ("temperature", "top_k", "top_p", "min_p"):
        setattr(meta, name, getattr(meta, name).expand(n).contiguous())
    meta.offsets = torch.arange(n, dtype=torch.int64)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        setattr(meta, name, getattr(meta, name).expand(n).contiguous())
    ids = ref.sample(logits.expand(n, 8).contiguous(), meta)
    counts = torch.bincount(ids, minlength=8).double()
    expect = torch.softmax(logits.double() / temp, 0) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 30.0, (chi2, counts, expect)  # 7 dof: P(chi2 > 30) < 1e-4
    # with top-k 3 only the 3 most likely appear, in their renormalised proportions
    meta.top_k = torch.full((n,), 3, dtype=torch.int32)
    ids = ref.sample(logits.expand(n, 8).contiguous(), meta)
    counts = torch.bincount(ids, minlength=8).double()
    assert set(ids.unique().tolist()) == {0, 1, 5}
    top = torch.softmax(logits[[0, 1, 5]].double() / temp, 0) * n
    chi2 = float(((counts[[0, 1, 5]] - top) ** 2 / top).sum())
    assert chi2 < 20.0, chi2  # 2 dof


def test_seeds_and_offsets_from_sequences():
    a = _seq(3, outputs=(1, 2), temperature=1.0, seed=2**64 + 5)
    b = _seq(9, temperature=1.0)
    cols = smp.sampling_columns([a, b])
    assert cols["seeds"] == [5, smp.derived_seed(9)]
    assert cols["offsets"] == [2, 0]
    assert smp.splitmix64(0) == 0xE220A8397B1DCDAF  # first SplitMix64 output from state 0
    assert smp.derived_seed(9) != smp.derived_seed(10)
    assert smp.row_seed(_seq(seed=-1)) == -1 and smp.row_seed(_seq(seed=2**63)) == -(2**63)


def test_logprob_tensor_packs_ids_and_logprobs():
    logits = _random_logits(2, 50, 6)
    meta = _meta([{"logprobs": 2}, {"temperature": 1.0, "top_k": 3, "logprobs": 4}], 50)
    ids = ref.sample(logits, meta)
    packed = smp.logprob_tensor(logits, meta, ids, meta.num_logprobs)
    rows = smp.unpack_logprobs(packed.tolist(), [_seq(logprobs=2), _seq(logprobs=4)])
    lp0 = torch.log_softmax(logits[0].double(), 0)
    assert rows[0].token_id == ids[0].item() == int(lp0.argmax())
    assert math.isclose(rows[0].logprob, float(lp0.max()), abs_tol=1e-5)
    assert len(rows[0].top) == 2 and len(rows[1].top) == 4
    assert rows[1].top[3][1] == NINF  # only 3 tokens survive top-k
    assert math.isclose(sum(math.exp(v) for _, v in rows[1].top[:3]), 1.0, abs_tol=1e-5)
