"""Async scheduling over the slot arrays (runtime/scheduler_ahead.py, ``DecodeRows.
valid_ahead``): every decision the step ahead takes from the slots equals the one the
objects give, checked on every call of a run on CPU with the torch backend and a tiny Llama:
``schedule_ahead``'s rows and new blocks (against the per-row loop on a copy of the
scheduler), ``ahead_ok``, ``ahead_src_rows``, ``graph_eligible`` and the step inputs of a
batch scheduled ahead (against the same batch without its slot rows). The runs with the
vectorised paths on every batch (their row threshold lowered to 1) give the tokens, step
records and per-request token times of the per-row paths (threshold above any batch), also
with stops inside the window of a step ahead, preemption, chunked prefill and the CUDA-graph
path.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from helpers.runner import tiny_runtime
from helpers.scenarios import (
    PROMPTS,
    SHARED_PREFIX_PROMPTS,
    greedy,
    mixed_sampling,
    model_eos,
    stop_id_params,
    stop_string_params,
)
from llmc.runtime import cuda_graphs, engine_step, executor
from llmc.runtime.executor import Executor
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.step_inputs import StepInputBuilder
from llmc.runtime.types import FinishReason, SamplingParams, ScheduledBatch, Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_weights, tiny_tok):
    return (*tiny_llama_weights, tiny_tok)


def _rows(picked):
    return [(ss.seq.request_id, ss.seq.branch, ss.start_position, ss.num_new_tokens)
            for ss in picked]  # fmt: skip


@pytest.fixture
def compared(monkeypatch):
    """Each slot-array decision of the step ahead compared with the objects' one; returns
    the counts of comparisons made (by kind), read after the run."""
    made = dict.fromkeys(("schedule_ahead", "ahead_ok", "src_rows", "eligible", "inputs"), 0)
    over_slots = Scheduler._ahead_over_slots

    def ahead_both(self, prev):
        twin, twin_prev = copy.deepcopy((self, prev), {id(np): np})  # (SlotState keeps np)
        got = over_slots(self, prev)
        if got is not None:
            want = twin._ahead_loop(twin_prev)
            assert _rows(got[0]) == _rows(want)
            for ss, ws in zip(got[0], want, strict=True):
                assert ss.seq.block_table == ws.seq.block_table
            assert self.kv.num_free_blocks == twin.kv.num_free_blocks
            assert (got[1] is None) == (len(want) < self.vector_rows)
            made["schedule_ahead"] += 1
        return got

    monkeypatch.setattr(Scheduler, "_ahead_over_slots", ahead_both)

    def objects(batch):
        return dataclasses.replace(batch, rows=None, prefix_rows=None)

    def both(fn, key):
        def run(*args):
            got = fn(*args)
            batches = [a for a in args if isinstance(a, ScheduledBatch)]
            if any(b.rows is not None or b.prefix_rows is not None for b in batches):
                bare = [objects(a) if isinstance(a, ScheduledBatch) else a for a in args]
                assert got == fn(*bare)
                made[key] += 1
            return got

        return run

    monkeypatch.setattr(executor, "ahead_ok", both(engine_step.ahead_ok, "ahead_ok"))
    monkeypatch.setattr(executor, "ahead_src_rows", both(engine_step.ahead_src_rows, "src_rows"))
    monkeypatch.setattr(cuda_graphs, "graph_eligible", both(cuda_graphs.graph_eligible, "eligible"))
    decode_step = StepInputBuilder.decode_step

    def inputs_both(self, batch, src_rows=None, span=None):
        got = decode_step(self, batch, src_rows, span)
        if batch.rows is not None and src_rows is not None:
            want = decode_step(self, objects(batch), src_rows, span)
            for g, w in zip((*got[0], *got[1].values(), got[2]), (*want[0], *want[1].values(),
                            want[2]), strict=True):  # fmt: skip
                np.testing.assert_array_equal(g, w)
            made["inputs"] += 1
        return got

    monkeypatch.setattr(StepInputBuilder, "decode_step", inputs_both)
    return made


def run(tiny, sampling, prompts, *, vector, monkeypatch, ahead_busy_rows=64, **kw):
    monkeypatch.setattr(Scheduler, "vector_rows", 1 if vector else 1 << 30)
    rt = tiny_runtime(tiny, **kw)
    ex = Executor(rt, async_scheduling=True, ahead_busy_rows=ahead_busy_rows)
    outs = ex.generate(prompts, sampling)
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks
    assert rt.scheduler.slots.num_used == 0
    return outs, ex


def observed(outs, ex):
    """What a run shows: tokens, text, finish reasons; its steps; each request's timings
    (counted: the times themselves differ between runs)."""
    steps = [(r.step_id, r.batch_size, r.num_tokens, r.num_decode_tokens, r.num_preempted)
             for r in ex.step_records]  # fmt: skip
    times = [(len(o.record.token_times), o.record.first_token_time is not None) for o in outs]
    toks = [(o.token_ids, o.text, o.finish_reason) for o in outs]
    return toks, steps, times, ex.num_ahead_steps


def ref(tiny, monkeypatch):
    return run(tiny, greedy((20,) * 6), PROMPTS, vector=False, monkeypatch=monkeypatch)[0]


SCENARIOS = {
    "greedy": lambda r: (greedy(), PROMPTS, {}),
    "greedy-graph-path": lambda r: (greedy(), PROMPTS, {"graphs": True}),
    "seeded-graph-path": lambda r: (mixed_sampling(), PROMPTS, {"graphs": True}),
    "model-eos": lambda r: (model_eos(), PROMPTS, {}),
    "stop-ids": lambda r: (stop_id_params(r, 3), PROMPTS, {"graphs": True}),
    "stop-strings": lambda r: (stop_string_params(r), PROMPTS, {}),
    "chunked-prefix": lambda r: (greedy(), SHARED_PREFIX_PROMPTS, {"max_num_tokens": 10}),
    "preemption": lambda r: (
        greedy((24, 20, 22, 18, 24, 20)),
        PROMPTS,
        {"num_blocks": 16, "scheduler_policy": "max_utilization"},
    ),
    # more requests than rows, every step ahead (admissions and prompt chunks ahead)
    "admissions-ahead": lambda r: (
        greedy((9, 14, 5, 20, 12, 7) * 2 + (6, 11)),
        PROMPTS + SHARED_PREFIX_PROMPTS + [[40 + j for j in range(9)], [77, 78]],
        {"ahead_busy_rows": 1, "max_num_tokens": 16},
    ),
    "penalty-and-logprobs": lambda r: (
        [
            SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2),
            *greedy((9, 14, 5, 8)),
        ],
        PROMPTS,
        {},
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_step_ahead_over_slots_equals_the_objects(tiny, monkeypatch, compared, name):
    sp, prompts, kw = SCENARIOS[name](ref(tiny, monkeypatch))
    scalar = observed(*run(tiny, sp, prompts, vector=False, monkeypatch=monkeypatch, **kw))
    assert compared["schedule_ahead"] == compared["inputs"] == 0
    vector = observed(*run(tiny, sp, prompts, vector=True, monkeypatch=monkeypatch, **kw))
    assert vector == scalar
    if name != "penalty-and-logprobs":  # (its steps ahead start when those two finished)
        assert scalar[3] > 0, "no step ran ahead"
    assert compared["schedule_ahead"] > 0 and compared["ahead_ok"] > 0
    assert compared["inputs"] > 0 and compared["src_rows"] > 0
    if kw.get("graphs"):
        assert compared["eligible"] > 0


def test_rows_scheduled_ahead_are_valid_ahead_until_the_update(monkeypatch):
    """A batch scheduled ahead reads its slots before the step in flight is updated
    (``valid_ahead``: one token short), and as any batch of slot rows after it (``valid``);
    a row that stops running makes neither hold (``current`` is false)."""
    from helpers.fakes import make_scheduler

    monkeypatch.setattr(Scheduler, "vector_rows", 1)
    s = make_scheduler(32, max_batch_size=4, max_num_tokens=64, max_seq_len=64,
                       max_input_len=32, tokens_per_block=4)  # fmt: skip
    seqs = [Sequence(i, [5, 6, 7 + i], SamplingParams(max_new_tokens=9, ignore_eos=True), 9, 0.0)
            for i in range(3)]  # fmt: skip
    for q in seqs:
        s.add(q)
    s.update(s.schedule(), [30, 31, 32])  # the prompts (no slot rows: prefill)
    cur = s.schedule()
    ahead = s.schedule_ahead(cur)
    assert cur.rows.valid(3) and ahead.rows.valid_ahead(3) and not ahead.rows.valid(3)
    assert list(ahead.rows.start) == [4, 4, 4]
    s.update(cur, [40, 41, 42])
    assert ahead.rows.valid(3) and not ahead.rows.valid_ahead(3)
    s.finish(1, FinishReason.CANCELLED)
    assert not ahead.rows.current(3) and not ahead.rows.valid(3)
