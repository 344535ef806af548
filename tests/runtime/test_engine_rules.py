"""Each rule of the engine core has one named home, and everyone who needs it asks there:

- plain sampling: ``SamplingParams.is_plain`` (CUDA-graph eligibility, async scheduling,
  the decode row cache's flag);
- the last token by length: ``Sequence.is_last_by_length`` (``Scheduler.update``,
  ``Scheduler.schedule_ahead``, ``engine_step.ahead_ok``);
- stop decisions: ``Scheduler.update`` records them (``finish_reason``, ``stop_token_id``)
  and ``emit_step_responses`` reads them instead of deciding again.

The tests replace a rule's home and check that every user follows, so a copy of the rule
that crept back somewhere fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import fakes
from llmc.runtime import types
from llmc.runtime.cuda_graphs import graph_eligible
from llmc.runtime.decode_row_cache import DecodeRowCache
from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.engine_step import ahead_ok, emit_step_responses
from llmc.runtime.records import RequestRecord
from llmc.runtime.request_state import RequestState
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.types import (
    FinishReason,
    Request,
    SamplingParams,
    ScheduledBatch,
    ScheduledSequence,
    Sequence,
    SequenceStatus,
)

EOS = 2


def make_scheduler(max_seq_len: int = 64, num_blocks: int = 64) -> Scheduler:
    return fakes.make_scheduler(
        num_blocks,
        eos=(EOS,),
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=max_seq_len,
        max_input_len=min(32, max_seq_len),
        tokens_per_block=4,
    )


def decoding(rid: int, sp: SamplingParams, n_out: int = 2) -> ScheduledSequence:
    """A sequence with a 3-token prompt and ``n_out`` outputs, scheduled for its next token."""
    seq = Sequence(rid, [5, 6, 7], sp, sp.max_new_tokens, 0.0)
    seq.output_token_ids = [9] * n_out
    return ScheduledSequence(seq, seq.num_tokens - 1, 1, True)


# ---- plain sampling ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "plain"),
    [
        ({}, True),
        ({"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "seed": 3}, True),
        ({"stop_token_ids": (4,), "stop": ("x",)}, True),
        ({"logprobs": 0}, False),
        ({"repetition_penalty": 1.1}, False),
        ({"presence_penalty": 0.5}, False),
        ({"frequency_penalty": -0.5}, False),
    ],
)
def test_plain_sampling_predicate(kw, plain) -> None:
    sp = SamplingParams(max_new_tokens=8, **kw)
    assert sp.is_plain is plain
    batch = ScheduledBatch(0, (decoding(0, SamplingParams(max_new_tokens=8)), decoding(1, sp)))
    assert graph_eligible(batch) is plain
    assert ahead_ok(batch) is plain
    cache = DecodeRowCache(4, 4)
    rows = cache.rows([ss.seq for ss in batch.sequences], np.zeros(2, dtype=np.int64))
    assert cache.plain[rows].tolist() == [True, plain]


def test_every_fast_path_asks_is_plain(monkeypatch) -> None:
    batch = ScheduledBatch(0, (decoding(0, SamplingParams(max_new_tokens=8)),))
    assert graph_eligible(batch) and ahead_ok(batch)
    monkeypatch.setattr(SamplingParams, "is_plain", property(lambda self: False))
    assert not graph_eligible(batch)
    assert not ahead_ok(batch)
    cache = DecodeRowCache(4, 4)
    assert not cache.plain[cache.rows([batch.sequences[0].seq], np.zeros(1, np.int64))].any()


# ---- the last token by length -----------------------------------------------------------
def test_max_new_tokens_is_the_whole_length_rule() -> None:
    """Admission folds max_seq_len into max_new_tokens, so the rule needs no max_seq_len."""
    s = make_scheduler(max_seq_len=16)
    sp = SamplingParams(max_new_tokens=50, ignore_eos=True, clamp_max_new_tokens=True)
    seq = Sequence(0, list(range(10, 20)), sp, 50, 0.0)
    s.add(seq)
    assert seq.max_new_tokens == 6
    assert [seq.is_last_by_length(n) for n in (5, 6, 7)] == [False, True, True]
    while s.has_unfinished():
        batch = s.schedule()
        s.update(batch, [30] * sum(x.sample for x in batch.sequences))
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_tokens == 16


def test_every_length_decision_asks_is_last_by_length(monkeypatch) -> None:
    monkeypatch.setattr(Sequence, "is_last_by_length", lambda self, n: n >= 2)
    # (the slot arrays' paths ask the same rule of whole rows: ``types.last_by_length``)
    monkeypatch.setattr(types, "last_by_length", lambda n, max_new: n >= 2)
    s = make_scheduler()
    a = Sequence(0, [5, 6, 7], SamplingParams(max_new_tokens=9, ignore_eos=True), 9, 0.0)
    b = Sequence(1, [5, 6, 8], SamplingParams(max_new_tokens=9, ignore_eos=True), 9, 0.0)
    s.add(a)
    s.add(b)
    first = s.schedule()
    s.update(first, [30, 31])
    second = s.schedule()
    assert ahead_ok(second) is False  # its tokens are the last ones
    assert s.schedule_ahead(second) is None  # nothing left to decode after them
    assert s.update(second, [32, 33]) == [a, b]
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [30, 32]


# ---- stop decisions ---------------------------------------------------------------------
def test_update_records_each_stop_decision() -> None:
    s = make_scheduler()
    eos = Sequence(0, [5, 6], SamplingParams(max_new_tokens=9), 9, 0.0)
    stop = Sequence(1, [5, 7], SamplingParams(max_new_tokens=9, stop_token_ids=(40,)), 9, 0.0)
    length = Sequence(2, [5, 8], SamplingParams(max_new_tokens=1, stop_token_ids=(41,)), 1, 0.0)
    kept = Sequence(3, [5, 9], SamplingParams(max_new_tokens=9, ignore_eos=True), 9, 0.0)
    for seq in (eos, stop, length, kept):
        s.add(seq)
    assert s.update(s.schedule(), [EOS, 40, 42, EOS]) == [eos, stop, length]
    assert [x.finish_reason for x in (eos, stop, length)] == [
        FinishReason.STOP,
        FinishReason.STOP,
        FinishReason.LENGTH,
    ]
    assert [x.stop_token_id for x in (eos, stop, length, kept)] == [EOS, 40, None, None]
    assert kept.status is SequenceStatus.RUNNING
    s.finish(3, FinishReason.STOP)  # decided outside (a stop string): no stop token
    assert kept.finish_reason is FinishReason.STOP and kept.stop_token_id is None


class _Finisher:
    def __init__(self) -> None:
        self.calls: list[tuple[int, FinishReason]] = []

    def finish(self, request_id: int, reason: FinishReason) -> None:
        self.calls.append((request_id, reason))


class _Out:
    logprobs = None


def _finished_state(tiny_tok, token_id: int, stop_token_id: int | None, stop: tuple[str, ...] = ()):
    text = tiny_tok.encode("ab", add_special_tokens=False)
    seq = Sequence(0, [5, 6], SamplingParams(max_new_tokens=9, stop=stop), 9, 0.0)
    seq.output_token_ids = [*text, token_id]
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = FinishReason.STOP
    seq.stop_token_id = stop_token_id
    state = RequestState(Request(prompt_token_ids=[5, 6]), RequestRecord(0, 0.0, 2), seq=seq)
    state.detok = IncrementalDetokenizer(tiny_tok, stop)
    state.num_seen = state.num_text = len(text)
    state.detok.add_tokens(text)
    return state


def test_responses_read_the_stop_decision(tiny_tok) -> None:
    """The text of the finishing token is dropped exactly when update says it was a stop
    token, whatever the token is (here one no stop list names)."""
    hello = tiny_tok.encode(" hello", add_special_tokens=False)[-1]
    with_it = tiny_tok.decode([*tiny_tok.encode("ab", add_special_tokens=False), hello])
    assert with_it != "ab"
    for stop_token_id, text in ((hello, "ab"), (None, with_it)):
        state = _finished_state(tiny_tok, hello, stop_token_id)
        batch = ScheduledBatch(0, (ScheduledSequence(state.seq, 2, 1, True),))
        got = []
        emit_step_responses(batch, _Out(), 1.0, {0: state}, _Finisher(), got.append)
        assert [r.text for r in got] == [text]
        assert got[0].finish_reason is FinishReason.STOP and got[0].token_ids[-1] == hello


def test_a_stop_string_is_the_one_stop_decided_after_update(tiny_tok) -> None:
    """Only the text shows a stop string: post-processing finishes the request through
    ``Scheduler.finish``, and nothing else finishes there."""
    ids = tiny_tok.encode("ab cd", add_special_tokens=False)
    seq = Sequence(0, [5, 6], SamplingParams(max_new_tokens=9, stop=("cd",)), 9, 0.0)
    seq.status = SequenceStatus.RUNNING
    state = RequestState(Request(prompt_token_ids=[5, 6]), RequestRecord(0, 0.0, 2), seq=seq)
    state.detok = IncrementalDetokenizer(tiny_tok, ("cd",))
    finisher, got = _Finisher(), []
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        batch = ScheduledBatch(i, (ScheduledSequence(seq, 1 + i, 1, True),))
        emit_step_responses(batch, _Out(), 1.0, {0: state}, finisher, got.append)
    assert finisher.calls == [(0, FinishReason.STOP)]
    assert [r.text for r in got if r.is_final] == ["ab "]
