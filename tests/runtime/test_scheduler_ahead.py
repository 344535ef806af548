"""``Scheduler.schedule_ahead``'s step that admits (``_ahead_mixed``), decided before the
step in flight is updated: which rows it has, which blocks and rows it takes, and when it
declines (None, nothing changed). No torch: a Scheduler over a KVCacheManager."""

from __future__ import annotations

import pytest

from helpers.fakes import make_scheduler
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.slot_state import DecodeRows
from llmc.runtime.types import SamplingParams, Sequence


def _seq(rid: int, prompt_len: int, max_new: int, **kw) -> Sequence:
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **kw)
    return Sequence(rid, [5 + (rid * 3 + j) % 40 for j in range(prompt_len)], sp, max_new, 0.0)


def _rows(batch):
    return [(ss.seq.request_id, ss.start_position, ss.num_new_tokens, ss.sample)
            for ss in batch.sequences]  # fmt: skip


def _sched(num_blocks=64, **kw) -> Scheduler:
    limits = dict(max_batch_size=3, max_num_tokens=32, max_seq_len=64, max_input_len=32,
                  tokens_per_block=4)  # fmt: skip
    limits.update(kw)
    return make_scheduler(num_blocks, **limits)


@pytest.fixture(params=[1, 1 << 30], ids=["slot-rows", "per-row"])
def vector(request, monkeypatch):
    monkeypatch.setattr(Scheduler, "vector_rows", request.param)
    return request.param


def test_a_row_ending_by_length_frees_its_row_for_an_admission_ahead(vector):
    s = _sched()
    a, b, c, d = _seq(0, 3, 9), _seq(1, 3, 2), _seq(2, 3, 9), _seq(3, 5, 9)
    for q in (a, b, c, d):
        s.add(q)
    s.update(s.schedule(), [30, 31, 32])  # a, b, c prefilled (3 rows); d waits
    prev = s.schedule()  # b's second token is its last by length
    assert _rows(prev) == [(0, 3, 1, True), (1, 3, 1, True), (2, 3, 1, True)]
    ahead = s.schedule_ahead(prev)
    # a and c decode from prev's tokens (positions 4), b is left out, d is admitted whole
    assert _rows(ahead) == [(0, 4, 1, True), (2, 4, 1, True), (3, 0, 5, True)]
    pre = ahead.prefix_rows
    assert (pre is not None) == (vector == 1)
    if pre is not None:
        assert isinstance(pre, DecodeRows) and pre.valid_ahead(2) and not pre.valid(2)
    s.update(prev, [40, 41, 42])
    assert b.finish_reason is not None and s.num_running == 3
    if pre is not None:
        assert pre.valid(2)
    s.update(ahead, [50, 51, 52])
    assert a.output_token_ids == [30, 40, 50] and d.output_token_ids == [52]
    s.kv.check_invariants()


def test_a_prompt_cut_by_the_budget_continues_ahead(vector):
    s = _sched(max_num_tokens=8)
    a, b = _seq(0, 3, 9), _seq(1, 20, 4)
    s.add(a)
    s.update(s.schedule(), [30])
    s.add(b)
    prev = s.schedule()  # a decodes, b's first chunk takes the rest of the budget
    assert _rows(prev) == [(0, 3, 1, True), (1, 0, 7, False)]
    ahead = s.schedule_ahead(prev)
    assert _rows(ahead) == [(0, 4, 1, True), (1, 7, 7, False)]
    s.update(prev, [40])
    last = s.schedule_ahead(ahead)  # b's last chunk samples its first token
    assert _rows(last) == [(0, 5, 1, True), (1, 14, 6, True)]
    assert s.schedule_ahead(last) is None  # (last is not updated: ahead is in flight)
    s.update(ahead, [50])
    assert b.num_computed_tokens == 14 and a.output_token_ids == [30, 40, 50]
    s.update(last, [60, 61])
    assert b.output_token_ids == [61] and b.num_computed_tokens == 20


def test_admission_ahead_stops_at_a_request_with_several_sequences(vector):
    s = _sched()
    s.add(_seq(0, 3, 9))
    s.update(s.schedule(), [30])
    prev = s.schedule()  # a decode step in flight
    s.add(_seq(1, 3, 9, n=2, temperature=1.0, seed=1))  # two samples: the host forks them
    s.add(_seq(2, 3, 9))  # (queued behind it: no overtaking)
    ahead = s.schedule_ahead(prev)
    assert _rows(ahead) == [(0, 4, 1, True)] and s.num_waiting == 2
    s.update(prev, [40])
    s.update(ahead, [50])
    assert [r[0] for r in _rows(s.schedule())] == [0, 1]  # admitted synchronously


@pytest.mark.parametrize("kind", ["shared-last-block", "no-blocks", "stale"])
def test_the_step_ahead_declines_and_changes_nothing(vector, kind):
    # no-blocks: 3 blocks of 4 tokens; a (8 tokens) and b (3) hold them all, and a's next
    # token (position 8) starts a new block
    s = _sched(num_blocks=3 if kind == "no-blocks" else 64, max_input_len=8, max_seq_len=12)
    if kind == "no-blocks":
        from helpers.fakes import make_scheduler

        s = make_scheduler(3, policy="max_utilization", max_batch_size=3, max_num_tokens=32,
                           max_seq_len=12, max_input_len=8, tokens_per_block=4)  # fmt: skip
    a, b = _seq(0, 7, 4), _seq(1, 3, 4)
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [30, 31])
    prev = s.schedule()  # a computes position 7 (its block's last), b position 3
    assert _rows(prev) == [(0, 7, 1, True), (1, 3, 1, True)]
    s.add(_seq(2, 3, 4))  # one waits: the step ahead would admit
    if kind == "shared-last-block":
        a.shares_last_block = True  # (as a forked sample's is: its next write copies)
        s.slots.write(a)
    if kind == "stale":
        s.update(prev, [40, 41])  # (prev's ids are known: no step is ahead of it)
    free, used = s.kv.num_free_blocks, s.slots.num_used
    steps, waiting = s.stats().num_steps, s.num_waiting
    assert s.schedule_ahead(prev) is None
    assert (s.kv.num_free_blocks, s.slots.num_used) == (free, used)
    assert (s.stats().num_steps, s.num_waiting) == (steps, waiting)


@pytest.mark.parametrize("reuse", [True, False])
def test_admission_ahead_waits_for_the_prefix_blocks_the_step_in_flight_fills(vector, reuse):
    """A waiting request whose prefix runs into blocks that ``prev``'s prompt chunk fills is
    left for the step after ``prev``'s update, which shares them (with block reuse; without
    it nothing is shared and it is admitted at once)."""
    from helpers.fakes import make_scheduler

    s = make_scheduler(64, reuse=reuse, max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                       max_input_len=32, tokens_per_block=4)  # fmt: skip
    sp = SamplingParams(max_new_tokens=9, ignore_eos=True)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    x = _seq(9, 3, 9)
    s.add(x)
    s.update(s.schedule(), [30])
    s.add(Sequence(0, [*shared, 50, 51, 52, 53], sp, 9, 0.0))
    prev = s.schedule()  # x decodes, a's 12-token prompt fills three blocks
    assert _rows(prev) == [(9, 3, 1, True), (0, 0, 12, True)]
    b = Sequence(1, [*shared, 60, 61, 62], sp, 9, 0.0)
    s.add(b)
    ahead = s.schedule_ahead(prev)
    if not reuse:
        assert _rows(ahead)[-1] == (1, 0, 11, True) and s.num_waiting == 0
        return
    assert _rows(ahead) == [(9, 4, 1, True), (0, 12, 1, True)] and s.num_waiting == 1
    s.update(prev, [40, 41])
    after = s.schedule_ahead(ahead)
    assert _rows(after)[-1] == (1, 8, 3, True)  # its first two blocks shared
    assert b.num_cached_tokens == 8
