"""The scheduler's slot arrays (runtime/slot_state.py) equal the Sequence objects after every
scheduler call, over mixed workloads on CPU with the torch backend and a tiny Llama: chunked
prefill with prefix reuse, preemption, finishes by length / EOS / stop ids / stop strings,
seeded sampling, multi-step windows (K = 4), async scheduling, the CUDA-graph path, n / best_of
samples and beams. The vectorised paths run on every batch (their row threshold lowered to 1)
and give the tokens of the per-row loop (threshold above any batch). Slots are all free at
the end."""

from __future__ import annotations

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
from llmc.runtime.executor import Executor
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.slot_state import SlotState
from llmc.runtime.step_inputs import StepInputBuilder
from llmc.runtime.types import FinishReason, Request, SamplingParams, Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHECKED = (
    "schedule",
    "schedule_ahead",
    "plan_window",
    "update",
    "update_window",
    "finish",
    "stop_inside_window",
)


@pytest.fixture(scope="module")
def tiny(tiny_llama_weights, tiny_tok):
    return (*tiny_llama_weights, tiny_tok)


@pytest.fixture
def mirrored(monkeypatch):
    """Every checked Scheduler call is followed by the mirror check, every decode step over
    slot rows compared with the same step from the objects; returns [checks made, updates
    the vectorised paths applied, decode steps compared] (read after the run)."""
    calls = [0]
    for name in CHECKED:
        original = getattr(Scheduler, name)

        def checked(self, *a, _original=original, _name=name, **kw):
            out = _original(self, *a, **kw)
            bad = self.check_slots()
            assert not bad, f"after {_name}: {bad[:5]}"
            reserved = []  # the promised blocks over the slot arrays and per row agree
            for rows in (1, 1 << 30):
                self.vector_rows = rows
                reserved.append(self._reserved_blocks())
            del self.vector_rows
            assert reserved[0] == reserved[1], f"after {_name}: reserved blocks {reserved}"
            calls[0] += 1
            return out

        monkeypatch.setattr(Scheduler, name, checked)
    calls.append(0)  # [1]: updates (of a step or a window) the vectorised paths applied
    calls.append(0)  # [2]: decode steps whose inputs came from the slot arrays
    calls.append(0)  # [3]: steps with prompt chunks whose decode prefix the slots applied
    prefix_current = Scheduler._prefix_current

    def counted_prefix(self, seqs, rows):
        out = prefix_current(self, seqs, rows)
        calls[3] += out
        return out

    monkeypatch.setattr(Scheduler, "_prefix_current", counted_prefix)
    decode_step = StepInputBuilder.decode_step

    def both(self, batch, src_rows=None, span=None):
        """The step inputs from the slots equal those from the objects, array for array."""
        got = decode_step(self, batch, src_rows, span)
        if batch.rows is not None and src_rows is None:
            want = decode_step(self, dataclasses.replace(batch, rows=None), src_rows, span)
            for g, w in zip((*got[0], *got[1].values(), got[2]), (*want[0], *want[1].values(),
                            want[2]), strict=True):  # fmt: skip
                np.testing.assert_array_equal(g, w)
            assert list(got[1]) == list(want[1])
            calls[2] += 1
        return got

    monkeypatch.setattr(StepInputBuilder, "decode_step", both)
    for name in ("_update_rows", "_update_window_rows"):
        vector = getattr(Scheduler, name)

        def counted(self, *a, _vector=vector):
            out = _vector(self, *a)
            calls[1] += out is not None
            return out

        monkeypatch.setattr(Scheduler, name, counted)
    return calls


def run(tiny, sampling, prompts, *, vector, monkeypatch, steps=1, async_scheduling=False, **kw):
    monkeypatch.setattr(Scheduler, "vector_rows", 1 if vector else 1 << 30)
    rt = tiny_runtime(tiny, decode_steps_per_iteration=steps, **kw)
    ex = Executor(rt, async_scheduling=async_scheduling)
    outs = ex.generate(prompts, sampling)
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks
    assert rt.scheduler.slots.num_used == 0  # every slot freed at finish / preemption
    return outs, ex


def tokens(outs):
    return [
        (o.token_ids, o.text, o.finish_reason, [c.token_ids for c in o.completions or []])
        for o in outs
    ]


def ref(tiny, monkeypatch):
    return run(tiny, greedy((20,) * 6), PROMPTS, vector=False, monkeypatch=monkeypatch)[0]


SCENARIOS = {
    "greedy": lambda r: (greedy(), PROMPTS, {}),
    "greedy-K4": lambda r: (greedy(), PROMPTS, {"steps": 4}),
    "seeded-K4": lambda r: (mixed_sampling(), PROMPTS, {"steps": 4}),
    "model-eos-K4": lambda r: (model_eos(), PROMPTS, {"steps": 4}),
    "stop-ids-K4": lambda r: (stop_id_params(r, 2), PROMPTS, {"steps": 4}),
    "stop-strings-K4": lambda r: (stop_string_params(r), PROMPTS, {"steps": 4}),
    "chunked-prefix-K4": lambda r: (
        greedy(),
        SHARED_PREFIX_PROMPTS,
        {"steps": 4, "max_num_tokens": 10},
    ),
    "chunked-prefix": lambda r: (greedy(), SHARED_PREFIX_PROMPTS, {"max_num_tokens": 10}),
    "preemption-K4": lambda r: (
        greedy((24, 20, 22, 18, 24, 20)),
        PROMPTS,
        {"steps": 4, "num_blocks": 16, "scheduler_policy": "max_utilization"},
    ),
    "async": lambda r: (greedy(), PROMPTS, {"async_scheduling": True}),
    "graph-path-K4": lambda r: (mixed_sampling(), PROMPTS, {"steps": 4, "graphs": True}),
    "min-tokens-penalty": lambda r: (
        [
            SamplingParams(max_new_tokens=12, min_tokens=6, stop_token_ids=(r[0].token_ids[2],)),
            SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=1.3),
            *greedy((9, 14, 5, 8)),
        ],
        PROMPTS,
        {"steps": 4},
    ),
    "samples-and-beams": lambda r: (
        [
            SamplingParams(max_new_tokens=8, ignore_eos=True, n=2, temperature=0.8, seed=1),
            SamplingParams(max_new_tokens=6, n=2, best_of=3, temperature=1.0, seed=4),
            SamplingParams(max_new_tokens=6, use_beam_search=True, beam_width=2),
        ],
        PROMPTS[:3],
        {"num_blocks": 40, "max_beam_width": 2},
    ),
    "samples-preempted": lambda r: (
        [
            SamplingParams(max_new_tokens=20, ignore_eos=True, n=2, temperature=0.8, seed=2),
            *greedy((24, 22, 18)),
        ],
        PROMPTS[:4],
        {"num_blocks": 16, "scheduler_policy": "max_utilization"},
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_slot_arrays_equal_the_objects_after_every_step(tiny, monkeypatch, mirrored, name):
    sp, prompts, kw = SCENARIOS[name](ref(tiny, monkeypatch))
    scalar, _ = run(tiny, sp, prompts, vector=False, monkeypatch=monkeypatch, **kw)
    checks_scalar = mirrored[0]
    assert mirrored[1] == 0
    vector, ex = run(tiny, sp, prompts, vector=True, monkeypatch=monkeypatch, **kw)
    assert mirrored[1] > 0 or "samples" in name  # the vectorised update ran (no groups)
    assert mirrored[2] > 0 or "samples" in name  # decode steps read inputs from the slots
    assert mirrored[3] > 0 or "chunked" not in name  # a decode prefix beside prompt chunks
    assert all(o.ok for o in vector), [o.error for o in vector]
    assert tokens(vector) == tokens(scalar)
    assert mirrored[0] > checks_scalar > len(ex.step_records)  # checked on every step
    if "preemption" in name or "preempted" in name:
        assert sum(r.num_preempted for r in ex.step_records) > 0
    if kw.get("steps", 1) > 1 and name != "min-tokens-penalty":
        assert any(r.num_steps > 1 for r in ex.step_records)


def test_the_mirror_check_names_a_field_that_differs(tiny, monkeypatch):
    monkeypatch.setattr(Scheduler, "vector_rows", 1)
    rt = tiny_runtime(tiny)
    ex = Executor(rt)
    for p in PROMPTS[:3]:
        ex.enqueue_request(Request(prompt_token_ids=p, sampling=greedy((8,))[0]))
    ex.step()
    ex.step()
    s = rt.scheduler
    assert s.check_slots() == []
    seq = s.running[1]
    s.slots.computed[seq.slot] += 1
    assert s.check_slots() == [
        f"request {seq.request_id} branch 0: computed is {seq.num_computed_tokens + 1} in "
        f"slot {seq.slot}, {seq.num_computed_tokens} on the object"
    ]
    s.slots.computed[seq.slot] -= 1
    seq.output_token_ids.append(9)  # changed behind the scheduler's back
    assert "num_out" in s.check_slots()[0]


def test_slots_are_reused_and_grow_past_their_capacity():
    st = SlotState(2, 4)
    seqs = [
        Sequence(request_id=i, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                 max_new_tokens=4, arrival_time=0.0)
        for i in range(3)
    ]  # fmt: skip
    assert [st.assign(s, frozenset({7})) for s in seqs] == [0, 1, 2]
    assert st.capacity == 4 and st.num_used == 3
    st.release(seqs[1])
    assert seqs[1].slot == -1
    assert st.assign(seqs[1], frozenset(range(40))) == 1  # the freed slot again
    assert st.many_stops[1] and not st.many_stops[0]
    assert st.mismatches(seqs, lambda s: range(40) if s is seqs[1] else {7}) == []


def test_the_slot_paths_ask_the_one_length_rule(monkeypatch):
    """The vectorised update decides length stops with ``types.last_by_length``, the rule
    ``Sequence.is_last_by_length`` states (patched here to end every request at 2 tokens)."""
    from helpers.fakes import make_scheduler
    from llmc.runtime import types

    monkeypatch.setattr(Scheduler, "vector_rows", 1)
    monkeypatch.setattr(types, "last_by_length", lambda n, limit: n >= 2)
    s = make_scheduler(
        64,
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=64,
        max_input_len=32,
        tokens_per_block=4,
    )
    a, b = (
        Sequence(i, [5, 6, 7 + i], SamplingParams(max_new_tokens=9, ignore_eos=True), 9, 0.0)
        for i in range(2)
    )
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [30, 31])  # the prompts' step (no slot rows: prefill)
    second = s.schedule()
    assert second.rows is not None
    assert s.update(second, [32, 33]) == [a, b]
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [30, 32] and s.slots.num_used == 0
