"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host)
gives token-for-token the output of the synchronous loop, on CPU with the torch backend and
a tiny Llama: greedy and seeded sampling, EOS / stop-token / stop-string / length stops,
cancellation mid-stream, preemption under a tiny pool, chunked prefill, prefix reuse, and the
CUDA-graph decode path (its staging and device-side token gather, replayed eagerly on CPU).
"""

from __future__ import annotations

import pytest

from helpers.runner import host_overhead_script, tiny_runtime
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
from llmc.runtime.types import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_weights, tiny_tok):
    return (*tiny_llama_weights, tiny_tok)


def make_runtime(tiny, **kw):
    return tiny_runtime(tiny, **kw)


def run(tiny, sampling, *, async_scheduling, prompts=PROMPTS, **kw):
    rt = make_runtime(tiny, **kw)
    ex = Executor(rt, async_scheduling=async_scheduling)
    outs = ex.generate(prompts, sampling)
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks
    return outs, ex


def same(tiny, sampling, prompts=PROMPTS, **kw):
    """Run sync and async; assert equal ids, text, finish reasons; return both runs."""
    sync, ex_s = run(tiny, sampling, async_scheduling=False, prompts=prompts, **kw)
    asyn, ex_a = run(tiny, sampling, async_scheduling=True, prompts=prompts, **kw)
    for a, b in zip(asyn, sync, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert a.finish_reason == b.finish_reason
    assert ex_s.num_ahead_steps == 0
    assert ex_a.num_ahead_steps > 0, "the async run never overlapped a step"
    return sync, asyn, ex_a


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_greedy_lengths_equal_sync(tiny, graphs):
    sync, _, ex = same(tiny, greedy(), graphs=graphs)
    assert [len(o.token_ids) for o in sync] == [9, 14, 5, 20, 12, 7]
    if graphs:
        assert ex.engine.runner.graphs.replays > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_seeded_and_unseeded_sampling_equal_sync(tiny, graphs):
    same(tiny, mixed_sampling(), graphs=graphs)


def test_stop_token_mid_stream_discards_the_extra_token(tiny):
    ref, _ = run(tiny, greedy((20,) * 6), async_scheduling=False)
    # each request stops at a token it really produces (the unknown-at-schedule-time case)
    sp = stop_id_params(ref, 3)
    sync, _, _ = same(tiny, sp)
    assert all(o.finish_reason.value == "stop" for o in sync)
    assert any(len(o.token_ids) < 20 for o in sync)


def test_stop_strings_equal_sync(tiny):
    ref, _ = run(tiny, greedy((24,) * 6), async_scheduling=False)
    sp = stop_string_params(ref)
    sync, _, _ = same(tiny, sp)
    assert any(o.finish_reason.value == "stop" for o in sync)


def test_eos_of_the_model_equals_sync(tiny):
    same(tiny, model_eos())


def test_preemption_tiny_pool_equals_roomy_sync(tiny):
    sp = greedy((24, 20, 22, 18, 24, 20))
    roomy, _ = run(tiny, sp, async_scheduling=False, num_blocks=64)
    tight, ex = run(
        tiny, sp, async_scheduling=True, num_blocks=16, scheduler_policy="max_utilization"
    )
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert sum(r.num_preempted for r in ex.step_records) > 0
    assert ex.num_ahead_steps > 0


def test_chunked_prefill_and_prefix_reuse_equal_sync(tiny):
    _, _, ex = same(tiny, greedy(), prompts=SHARED_PREFIX_PROMPTS, max_num_tokens=10)
    assert any(0 < r.num_prefill_tokens < r.num_tokens for r in ex.step_records)  # mixed steps
    assert ex.kv_stats().reuse_hits > 0


def test_cancel_mid_stream(tiny):
    prompts, sp = PROMPTS[:4], greedy((30, 30, 30, 30))
    ref, _ = run(tiny, sp, async_scheduling=False, prompts=prompts)
    rt = make_runtime(tiny)
    ex = Executor(rt, async_scheduling=True)
    ids = [
        ex.enqueue_request(Request(prompt_token_ids=p, sampling=s, streaming=True))
        for p, s in zip(prompts, sp, strict=True)
    ]
    got: dict[int, list[int]] = {i: [] for i in ids}
    finals = {}

    def collect():
        for r in ex.await_responses(timeout=0):
            got[r.request_id] += r.new_token_ids
            if r.is_final:
                finals[r.request_id] = r

    steps = 0
    while ex.step():
        steps += 1
        collect()
        if steps == 6:
            assert ex.cancel_request(ids[1])
    collect()
    assert len(finals) == len(ids)
    assert finals[ids[1]].finish_reason.value == "cancelled"
    cut = finals[ids[1]].token_ids
    assert got[ids[1]] == cut and 0 < len(cut) < 30
    assert cut == ref[1].token_ids[: len(cut)]
    for k in (0, 2, 3):
        assert finals[ids[k]].token_ids == ref[k].token_ids == got[ids[k]]
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks


def test_penalties_and_logprobs_stay_synchronous_and_equal(tiny):
    sp = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2),
    ]
    sync, _ = run(tiny, sp, async_scheduling=False, prompts=PROMPTS[:2])
    asyn, ex = run(tiny, sp, async_scheduling=True, prompts=PROMPTS[:2])
    assert [o.token_ids for o in asyn] == [o.token_ids for o in sync]
    assert ex.num_ahead_steps == 0
    assert [lp.token_id for lp in asyn[1].logprobs] == asyn[1].token_ids


def test_runner_refuses_a_third_unread_launch(tiny):
    rt = make_runtime(tiny)
    ex = Executor(rt, async_scheduling=False)
    ex.enqueue_request(Request(prompt_token_ids=[5, 6, 7], sampling=greedy((4,))[0]))
    batch = rt.scheduler.schedule()
    first = rt.runner.launch(batch)
    rt.runner.launch(batch)
    with pytest.raises(Exception, match="two launched steps are unread"):
        rt.runner.launch(batch)
    assert first.result() is first.result()  # read once, then cached
    rt.runner.launch(batch).result()  # one slot free again


@pytest.mark.parametrize("blocking_launch", [False, True])
def test_async_never_delays_the_first_token_on_a_simulated_device(blocking_launch):
    """Closed loop, one request at a time, on a simulated device (prefill 8 ms, decode 5 ms;
    ids on the host only when the step ends): TTFT and ITL with async scheduling are no worse
    than without, also when a launch returns only once its step has run (what the H200 run
    of e4fc115 looked like: TTFT + one decode step with async, same TPOT)."""
    import argparse
    import statistics

    ho = host_overhead_script()
    got = {}
    for asy in (False, True):
        args = argparse.Namespace(
            batch=2, isl=64, osl=6, path="graph", async_scheduling=asy, temperature=0.0, top_k=0
        )
        sims = []

        def wrap(r, sims=sims):
            sims.append(ho.SimulatedDevice(r, 0.008, 0.005, blocking_launch=blocking_launch))
            return sims[-1]

        ex = ho.build(args, wrap)
        ttft, itl = ho.closed_loop_latency(ex, 3, args.isl, args.osl)
        got[asy] = statistics.median(ttft), statistics.median(itl), ex.num_ahead_steps
    (ttft_s, itl_s, n_s), (ttft_a, itl_a, n_a) = got[False], got[True]
    assert n_s == 0 and n_a > 0
    assert ttft_s >= 0.008 and ttft_a >= 0.008  # the simulated prefill really ran
    assert ttft_a <= ttft_s + 0.0015, (ttft_a, ttft_s)
    assert itl_a <= itl_s + 0.0015, (itl_a, itl_s)


def test_ahead_src_rows_maps_each_ahead_row_to_its_input_row() -> None:
    """Same sequences in the same order → identity; otherwise each row finds its sequence's
    sampled row (prefill chunks that sample nothing are not rows)."""
    from llmc.runtime.engine_step import ahead_src_rows
    from llmc.runtime.types import SamplingParams, ScheduledBatch, ScheduledSequence, Sequence

    sp = SamplingParams(max_new_tokens=4)
    a, b, c = (Sequence(i, [1, 2, 3], sp, 4, 0.0) for i in range(3))
    prev = ScheduledBatch(
        0,
        (
            ScheduledSequence(a, 3, 1, True),
            ScheduledSequence(b, 3, 1, True),
            ScheduledSequence(c, 0, 2, False),  # a prompt's first chunk: no sampled row
        ),
    )
    same = ScheduledBatch(1, (ScheduledSequence(a, 4, 1, True), ScheduledSequence(b, 4, 1, True)))
    assert list(ahead_src_rows(prev, same)) == [0, 1]
    swapped = ScheduledBatch(1, (ScheduledSequence(b, 4, 1, True),))
    assert ahead_src_rows(prev, swapped) == [1]
    prev2 = ScheduledBatch(0, (ScheduledSequence(c, 2, 1, True), ScheduledSequence(a, 3, 1, True)))
    reordered = ScheduledBatch(
        1, (ScheduledSequence(a, 4, 1, True), ScheduledSequence(c, 3, 1, True))
    )
    assert ahead_src_rows(prev2, reordered) == [1, 0]


# ---- steps ahead with prompt chunks and admissions (``Scheduler._ahead_mixed``) ----------
MANY = PROMPTS + SHARED_PREFIX_PROMPTS + [[40 + j for j in range(9)], [77, 78]]
"""14 prompts for 6 rows: requests are admitted while others decode."""

AHEAD_MIXED = {
    "greedy": lambda r: (greedy((9, 14, 5, 20, 12, 7) * 2 + (6, 11)), MANY, {}),
    "graph-path": lambda r: (greedy((9, 14, 5, 20, 12, 7) * 2 + (6, 11)), MANY, {"graphs": True}),
    "seeded": lambda r: (mixed_sampling() * 2 + greedy((6, 11)), MANY, {}),
    "chunked": lambda r: (
        greedy((9, 14, 5, 20, 12, 7) * 2 + (6, 11)),
        MANY,
        {"max_num_tokens": 10},
    ),
    "stop-ids": lambda r: (stop_id_params(r, 2) * 2 + greedy((6, 11)), MANY, {"graphs": True}),
    "stop-strings": lambda r: (stop_string_params(r) * 2 + greedy((6, 11)), MANY, {}),
    "model-eos": lambda r: (model_eos() * 2 + greedy((6, 11)), MANY, {}),
    "preemption": lambda r: (
        greedy((24, 20, 22, 18, 24, 20) * 2 + (6, 11)),
        MANY,
        {"num_blocks": 20, "scheduler_policy": "max_utilization"},
    ),
    "samples-and-penalties": lambda r: (
        [
            SamplingParams(max_new_tokens=7, n=2, temperature=0.8, seed=5, ignore_eos=True),
            SamplingParams(max_new_tokens=9, ignore_eos=True, repetition_penalty=1.3),
            *greedy((9, 14, 5, 20, 12, 7, 9, 14, 5, 20, 6, 11)),
        ],
        MANY,
        {},
    ),
}


@pytest.mark.parametrize("name", list(AHEAD_MIXED))
def test_steps_ahead_with_prompt_chunks_and_admissions_equal_sync(tiny, name):
    """With ``ahead_busy_rows=1`` every plain step may have the next launched ahead of it,
    first and last tokens included, and the step ahead carries prompt chunks and
    admissions: tokens, text and finish reasons equal the synchronous loop's."""
    ref, _ = run(tiny, greedy((24,) * 6), async_scheduling=False)
    sp, prompts, kw = AHEAD_MIXED[name](ref)
    sync, _ = run(tiny, sp, async_scheduling=False, prompts=prompts, **kw)
    rt = make_runtime(tiny, **kw)
    ex = Executor(rt, async_scheduling=True, ahead_busy_rows=1)
    kinds = {"decode": 0, "chunks": 0, "admitted": 0}
    schedule_ahead = rt.scheduler.schedule_ahead

    def counted(prev):
        waiting = rt.scheduler.num_waiting
        got = schedule_ahead(prev)
        if got is not None:
            kinds["chunks" if got.num_tokens > len(got.sequences) else "decode"] += 1
            kinds["admitted"] += waiting - rt.scheduler.num_waiting
        return got

    rt.scheduler.schedule_ahead = counted
    asyn = ex.generate(prompts, sp)
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks and rt.scheduler.slots.num_used == 0
    for a, b in zip(asyn, sync, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert kinds["chunks"] > 0 and kinds["admitted"] > 0, kinds
    assert ex.num_ahead_steps == sum(kinds[k] for k in ("decode", "chunks")), kinds
    if name == "preemption":
        assert sum(r.num_preempted for r in ex.step_records) > 0


def test_a_busy_step_is_not_held_back_by_first_or_last_tokens():
    """``ahead_ok``'s ``busy_rows``: below it first / last tokens keep the next step
    synchronous; from it only a row's sampling kind does (penalties, logprobs)."""
    from llmc.runtime.engine_step import ahead_ok
    from llmc.runtime.types import ScheduledBatch, ScheduledSequence, Sequence

    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = [Sequence(i, [1, 2, 3], sp, 4, 0.0) for i in range(3)]
    batch = ScheduledBatch(0, tuple(ScheduledSequence(s, 0, 3, True) for s in first))
    assert not ahead_ok(batch) and not ahead_ok(batch, 4)
    assert ahead_ok(batch, 3) and ahead_ok(batch, 1)
    pen = Sequence(9, [1, 2, 3], SamplingParams(max_new_tokens=4, repetition_penalty=1.2), 4, 0.0)
    busy = ScheduledBatch(0, (*batch.sequences, ScheduledSequence(pen, 0, 3, True)))
    assert not ahead_ok(busy, 1)


def test_bad_src_rows_are_refused_naming_the_step(tiny):
    """``src_rows`` gives one entry per row, each a row of the previous step's ids or -1
    (the host's token); a prompt chunk never takes its token from the device."""
    from llmc.base.errors import EngineError

    rt = make_runtime(tiny)
    ex = Executor(rt, async_scheduling=False)
    for p in PROMPTS[:2]:
        ex.enqueue_request(Request(prompt_token_ids=p, sampling=greedy((4,))[0]))
    chunks = rt.scheduler.schedule()  # two prompts: chunks of 3 and 11 tokens
    inputs = rt.runner.inputs
    with pytest.raises(EngineError, match="step 0: src_rows must give a row per sequence"):
        inputs.prepare(chunks, [-1])
    with pytest.raises(EngineError, match="prompt chunk cannot take its token"):
        inputs.prepare(chunks, [0, -1])
    rt.scheduler.update(chunks, [7, 8])
    decode = rt.scheduler.schedule()
    with pytest.raises(EngineError, match=r"src_rows must give a row >= -1 per sequence"):
        inputs.prepare(decode, [-2, 0])
    inputs.prepare(decode, [-1, -1])  # (both tokens on the host: a plain decode step)


@pytest.mark.parametrize("bad", [0, -3, 1.5, "64"])
def test_ahead_busy_rows_must_be_a_positive_integer(tiny, bad):
    from llmc.base.errors import ConfigError

    with pytest.raises(ConfigError, match="ahead_busy_rows"):
        Executor(make_runtime(tiny), async_scheduling=True, ahead_busy_rows=bad)
