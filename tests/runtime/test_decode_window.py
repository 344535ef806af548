"""The pieces of multi-step decoding on their own: ``WindowState.advance`` (the device-side
token feedback and stop checks) on hand-made rows, and the scheduler's ``plan_window`` /
``update_window`` / ``stop_inside_window`` on a real Scheduler and KV manager (no model)."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import make_limits
from helpers.fakes import make_scheduler
from llmc.runtime.decode_window import STOP_WIDTH, WindowState, window_span
from llmc.runtime.types import (
    FinishReason,
    SamplingParams,
    ScheduledSequence,
    Sequence,
    SequenceStatus,
)

LIM = dict(max_batch_size=4, tokens_per_block=4, max_seq_len=96, max_num_tokens=64)


def sched_of(num_blocks, **kw):
    return make_scheduler(num_blocks, **{**LIM, **kw})


def seq(rid, prompt_len=3, max_new=10, outputs=(), **sp):
    s = Sequence(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_new_tokens=max_new, **sp),
        max_new_tokens=max_new,
        arrival_time=0.0,
    )
    s.output_token_ids = list(outputs)
    return s


# ---- WindowState.advance --------------------------------------------------------------
def test_advance_feeds_tokens_stops_rows_and_freezes_them():
    limits = make_limits(**LIM)
    win = WindowState(limits, torch.device("cpu"), 3)
    rows = (
        ScheduledSequence(seq(0, max_new=10, outputs=[9]), 3, 1, True),  # runs all 3 steps
        ScheduledSequence(seq(1, max_new=2, outputs=[9]), 3, 1, True),  # 1 token left
        ScheduledSequence(seq(2, max_new=10, outputs=[9], stop_token_ids=(77,)), 3, 1, True),
    )
    span = window_span(rows, 3)
    assert span.tolist() == [3, 1, 3]
    win.stage(rows, 4, frozenset({5}), span)  # row 3: padding
    assert win.done.tolist() == [False, False, False, True]
    assert win.stop[2, :2].tolist() == [5, 77] and win.stop[0, 0].item() == 5
    feed = {
        "input_ids": torch.tensor([9, 9, 9, 0]),
        "positions": torch.tensor([3, 3, 3, 0]),
        "slot_mapping": torch.tensor([3, 7, 11, -1]),
        "seq_lens": torch.tensor([4, 4, 4, 0], dtype=torch.int32),
        "offsets": torch.tensor([1, 1, 1, 0]),
    }
    tables = torch.tensor([[0, 4], [1, -1], [2, 5], [-1, -1]], dtype=torch.int32)
    win.advance(4, torch.tensor([20, 21, 77, 3]), feed, tables)
    # row 0 goes on into block 4; row 1 made its last token; row 2 hit its stop id
    assert feed["input_ids"].tolist() == [20, 0, 0, 0]
    assert feed["positions"].tolist() == [4, 3, 3, 0]
    assert feed["seq_lens"].tolist() == [5, 4, 4, 0]
    assert feed["slot_mapping"].tolist() == [16, -1, -1, -1]
    assert feed["offsets"].tolist() == [2, 2, 2, 1]
    win.advance(4, torch.tensor([30, 31, 32, 3]), feed, tables)
    win.advance(4, torch.tensor([40, 41, 42, 3]), feed, tables)
    host, event = win.read_back(3)
    assert event is None
    assert win.row_tokens(host, 3) == [[20, 30, 40], [21], [77]]
    # row 0 made its span's last token at the window's last step: it stops there too
    assert feed["positions"].tolist() == [5, 3, 3, 0]
    assert feed["slot_mapping"].tolist() == [-1, -1, -1, -1]
    assert win.done.tolist() == [True] * 4


def test_a_second_window_before_the_first_is_read_is_refused():
    win = WindowState(make_limits(**LIM), torch.device("cpu"), 2)
    row = (ScheduledSequence(seq(0, outputs=[1]), 3, 1, True),)
    win.stage(row, 1, frozenset(), window_span(row, 2))
    win.read_back(2)
    with pytest.raises(Exception, match="unread"):
        win.stage(row, 1, frozenset(), window_span(row, 2))


def test_stop_table_width_is_the_scheduler_bound():
    from llmc.runtime.types import MAX_WINDOW_STOP_IDS

    assert STOP_WIDTH == MAX_WINDOW_STOP_IDS


# ---- the scheduler ----------------------------------------------------------------------
def decoding(sched, seqs):
    """Admit ``seqs`` and run their prefill with a first token each (as update would)."""
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    sched.update(batch, [50] * len(batch.sequences))
    return sched.schedule()


def test_plan_window_clips_to_the_longest_row_and_reserves_blocks():
    sched = sched_of(64)
    a, b = seq(0, max_new=3), seq(1, max_new=30)
    batch = decoding(sched, [a, b])
    w = sched.plan_window(batch, 8)
    assert w.window is not None and w.window.num_steps == 8
    # a may make 2 more tokens: blocks for positions 3..4; b: 8 tokens, positions 3..10
    assert len(a.block_table) == 2 and len(b.block_table) == 3
    sched.update_window(w, [[60, 61], [60 + i for i in range(8)]])
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == [50, *range(60, 68)] and b.num_computed_tokens == 11
    short = seq(2, max_new=3)
    sched2 = sched_of(64)
    w2 = sched2.plan_window(decoding(sched2, [short]), 8)
    assert w2.window.num_steps == 2  # no row can use more


def test_plan_window_halves_k_to_fit_the_free_pool():
    sched = sched_of(6, policy="max_utilization")
    seqs = [seq(i, max_new=20) for i in range(2)]
    batch = decoding(sched, seqs)  # 2 blocks used, 4 free
    w = sched.plan_window(batch, 16)  # 16 would need 8 more blocks, 8 needs 4
    assert w.window.num_steps == 8
    assert sched.kv.num_free_blocks == 0


@pytest.mark.parametrize(
    "case",
    ["waiting_with_a_free_slot", "prefill_in_the_step", "penalty", "max_steps_1", "stop_ids"],
)
def test_plan_window_keeps_one_step(case):
    sched = sched_of(64)
    extra = {}
    if case == "penalty":
        extra = {"repetition_penalty": 1.2}
    if case == "stop_ids":
        extra = {"stop_token_ids": tuple(range(100, 117))}
    batch = decoding(sched, [seq(0, max_new=20, **extra)])
    if case == "waiting_with_a_free_slot":
        sched.add(seq(1, prompt_len=70))  # cannot be admitted this step (budget), but waits
        batch = sched.schedule()
    if case == "prefill_in_the_step":
        sched.add(seq(1))
        batch = sched.schedule()
    steps = 1 if case == "max_steps_1" else 4
    assert sched.plan_window(batch, steps) is batch


def test_update_window_stops_at_the_first_stop_id_and_refuses_a_short_row():
    sched = sched_of(64, eos=(7,))
    a, b = seq(0, max_new=20), seq(1, max_new=20)
    w = sched.plan_window(decoding(sched, [a, b]), 4)
    done = sched.update_window(w, [[60, 7], [61, 62, 63, 64]])
    assert done == [a] and a.output_token_ids == [50, 60, 7] and a.stop_token_id == 7
    assert sched.kv.num_free_blocks == sched.kv.total_blocks - len(b.block_table)
    w = sched.plan_window(sched.schedule(), 4)
    with pytest.raises(RuntimeError, match="runner bug"):
        sched.update_window(w, [[1, 2]])


def test_stop_inside_window_cuts_and_finishes():
    sched = sched_of(64)
    a = seq(0, max_new=20)
    w = sched.plan_window(decoding(sched, [a]), 4)
    sched.update_window(w, [[60, 61, 62, 63]])
    sched.stop_inside_window(a, 2)
    assert a.output_token_ids == [50, 60] and a.finish_reason is FinishReason.STOP
    assert sched.kv.num_free_blocks == sched.kv.total_blocks
    assert not sched.has_unfinished()
