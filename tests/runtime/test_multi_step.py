"""Multi-step decoding (K decode steps per host iteration, tokens fed back on the device)
gives token-for-token the output of one step per iteration, on CPU with the torch backend
and a tiny Llama: greedy and seeded sampling, EOS / stop ids / stop strings / max_tokens
inside a window, streaming in bursts, cancellation mid-window, preemption, chunked prefill,
mixed arrivals, async scheduling, and the CUDA-graph path (its staging and the captured
token feedback, replayed eagerly on CPU). The KV pool is fully free afterwards.
"""

from __future__ import annotations

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
from llmc.base.errors import ConfigError
from llmc.runtime.engine_runtime import RuntimeConfig
from llmc.runtime.executor import Executor
from llmc.runtime.types import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4


@pytest.fixture(scope="module")
def tiny(tiny_llama_weights, tiny_tok):
    return (*tiny_llama_weights, tiny_tok)


def make_runtime(tiny, *, steps=1, **kw):
    rt = tiny_runtime(tiny, decode_steps_per_iteration=steps, **kw)
    assert rt.decode_steps_per_iteration == steps
    return rt


def windows(ex: Executor) -> int:
    return sum(1 for r in ex.step_records if r.num_steps > 1)


def run(tiny, sampling, *, steps, prompts=PROMPTS, async_scheduling=False, **kw):
    rt = make_runtime(tiny, steps=steps, **kw)
    ex = Executor(rt, async_scheduling=async_scheduling)
    outs = ex.generate(prompts, sampling)
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks
    return outs, ex


def same(tiny, sampling, prompts=PROMPTS, **kw):
    """Run K = 1 and K = 4; assert equal ids, text, finish reasons; return both runs."""
    one, ex1 = run(tiny, sampling, steps=1, prompts=prompts, **kw)
    multi, exk = run(tiny, sampling, steps=K, prompts=prompts, **kw)
    for a, b in zip(multi, one, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert a.finish_reason == b.finish_reason
    assert windows(ex1) == 0
    assert windows(exk) > 0, "the K-step run never ran a window"
    assert len(exk.step_records) < len(ex1.step_records)
    return one, multi, exk


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_greedy_lengths_equal_single_step(tiny, graphs):
    one, _, ex = same(tiny, greedy(), graphs=graphs)
    assert [len(o.token_ids) for o in one] == [9, 14, 5, 20, 12, 7]  # max_tokens mid-window
    if graphs:
        assert ex.engine.runner.graphs.replays > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_seeded_and_unseeded_sampling_equal_single_step(tiny, graphs):
    same(tiny, mixed_sampling(), graphs=graphs)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_stop_ids_inside_a_window(tiny, graphs):
    ref, _ = run(tiny, greedy((20,) * 6), steps=1)
    # each request stops at a token it really produces, at varied places in a window
    sp = stop_id_params(ref, 2)
    one, _, _ = same(tiny, sp, graphs=graphs)
    assert all(o.finish_reason.value == "stop" for o in one)
    assert any(len(o.token_ids) < 20 for o in one)


def test_stop_strings_inside_a_window(tiny):
    ref, _ = run(tiny, greedy((24,) * 6), steps=1)
    sp = stop_string_params(ref)
    one, _, _ = same(tiny, sp)
    cut = [o for o in one if o.finish_reason.value == "stop"]
    assert cut and any(len(o.token_ids) % K for o in cut)  # some cut inside a window


def test_stop_string_and_stop_id_in_one_window(tiny):
    ref, _ = run(tiny, greedy((24,) * 6), steps=1)
    sp = []
    for o in ref:  # the stop id comes later in the window than the stop string's token
        s = o.text[len(o.text) // 3 : len(o.text) // 3 + 2]
        later = o.token_ids[min(len(o.token_ids) - 1, len(o.token_ids) // 3 + 3)]
        sp.append(
            SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(s,), stop_token_ids=(later,))
            if s.strip()
            else greedy()[0]
        )
    same(tiny, sp)


def test_eos_of_the_model_equals_single_step(tiny):
    same(tiny, model_eos())


def test_streaming_comes_in_bursts_of_at_most_k(tiny):
    sp = greedy((13, 9, 17, 6, 11, 15))
    ref, _ = run(tiny, sp, steps=1)
    rt = make_runtime(tiny, steps=K)
    ex = Executor(rt)
    ids = [
        ex.enqueue_request(Request(prompt_token_ids=p, sampling=s, streaming=True))
        for p, s in zip(PROMPTS, sp, strict=True)
    ]
    got = {i: [] for i in ids}
    text = {i: "" for i in ids}
    finals = {}
    while len(finals) < len(ids):
        for r in ex.await_responses(ids):
            assert r.request_id not in finals  # nothing after the final response
            assert len(r.new_token_ids) <= K
            got[r.request_id] += r.new_token_ids
            text[r.request_id] += r.new_text
            if r.is_final:
                finals[r.request_id] = r
    for i, o in zip(ids, ref, strict=True):
        assert got[i] == finals[i].token_ids == o.token_ids
        assert text[i] == finals[i].text == o.text
    assert windows(ex) > 0


def test_cancel_mid_window_delivers_no_later_token(tiny):
    prompts, sp = PROMPTS[:4], greedy((30, 30, 30, 30))
    ref, _ = run(tiny, sp, steps=1, prompts=prompts)
    rt = make_runtime(tiny, steps=K)
    ex = Executor(rt)
    ids = [
        ex.enqueue_request(Request(prompt_token_ids=p, sampling=s, streaming=True))
        for p, s in zip(prompts, sp, strict=True)
    ]
    runner, launches = rt.runner, []

    def launch(batch, src_rows=None):  # cancel while the third window runs on the device
        pending = type(runner).launch(runner, batch, src_rows)
        if batch.window is not None:
            launches.append(batch)
            if len(launches) == 3:
                assert ex.cancel_request(ids[1])
        return pending

    runner.launch = launch
    got: dict[int, list[int]] = {i: [] for i in ids}
    finals = {}
    while ex.step():
        for r in ex.await_responses(timeout=0):
            assert r.request_id not in finals
            got[r.request_id] += r.new_token_ids
            if r.is_final:
                finals[r.request_id] = r
    assert len(finals) == len(ids)
    assert finals[ids[1]].finish_reason.value == "cancelled"
    cut = finals[ids[1]].token_ids
    assert got[ids[1]] == cut and 0 < len(cut) < 30
    assert cut == ref[1].token_ids[: len(cut)]
    # none of the cancelled window's tokens was delivered
    seq = launches[2].sequences[[s.seq.request_id for s in launches[2].sequences].index(ids[1])]
    assert len(cut) == seq.start_position + 1 - len(prompts[1])
    for k in (0, 2, 3):
        assert finals[ids[k]].token_ids == ref[k].token_ids == got[ids[k]]
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks


def test_preemption_tiny_pool_equals_roomy_single_step(tiny):
    sp = greedy((24, 20, 22, 18, 24, 20))
    roomy, _ = run(tiny, sp, steps=1, num_blocks=64)
    tight, ex = run(tiny, sp, steps=K, num_blocks=16, scheduler_policy="max_utilization")
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert sum(r.num_preempted for r in ex.step_records) > 0
    assert windows(ex) > 0


def test_chunked_prefill_and_prefix_reuse_equal_single_step(tiny):
    _, _, ex = same(tiny, greedy(), prompts=SHARED_PREFIX_PROMPTS, max_num_tokens=10)
    assert any(0 < r.num_prefill_tokens < r.num_tokens for r in ex.step_records)  # mixed steps
    assert ex.kv_stats().reuse_hits > 0


def _staggered(tiny, steps, sp):
    """Requests arriving while others decode: two now, one more every third step."""
    rt = make_runtime(tiny, steps=steps)
    ex = Executor(rt)
    ids = [ex.enqueue_request(Request(prompt_token_ids=p, sampling=s))
           for p, s in zip(PROMPTS[:2], sp[:2], strict=True)]  # fmt: skip
    todo, n = list(zip(PROMPTS[2:], sp[2:], strict=True)), 0
    while ex.step() or todo:
        n += 1
        if todo and n % 3 == 0:
            p, s = todo.pop(0)
            ids.append(ex.enqueue_request(Request(prompt_token_ids=p, sampling=s)))
    outs = {r.request_id: r for r in ex.await_responses() if r.is_final}
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks
    return [outs[i].token_ids for i in ids], ex


def test_mixed_arrivals_equal_single_step(tiny):
    sp = greedy((20, 25, 9, 14, 11, 8))
    one, _ = _staggered(tiny, 1, sp)
    multi, ex = _staggered(tiny, K, sp)
    assert multi == one
    assert windows(ex) > 0
    # an arrival waits at most one window: its prefill is the iteration after it came
    assert any(r.num_prefill_tokens and r.num_steps == 1 for r in ex.step_records[3:])


def test_async_scheduling_with_windows_equals_single_step(tiny):
    sp = greedy((9, 14, 5, 20, 12, 7))
    one, _ = run(tiny, sp, steps=1)
    multi, ex = run(tiny, sp, steps=K, async_scheduling=True)
    assert [o.token_ids for o in multi] == [o.token_ids for o in one]
    assert windows(ex) > 0


def test_rows_that_need_the_host_stay_single_step(tiny):
    sp = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(max_new_tokens=8, ignore_eos=True, min_tokens=3),
        SamplingParams(max_new_tokens=8, ignore_eos=True, n=2, temperature=0.8, seed=1),
    ]
    for s in sp:
        one, _ = run(tiny, [s, greedy((8,))[0]], steps=1, prompts=PROMPTS[:2])
        multi, ex = run(tiny, [s, greedy((8,))[0]], steps=K, prompts=PROMPTS[:2])
        assert [o.token_ids for o in multi] == [o.token_ids for o in one]
        assert [c.token_ids for o in multi for c in o.completions or []] == [
            c.token_ids for o in one for c in o.completions or []
        ]
        assert windows(ex) == 0


def test_many_stop_ids_stay_single_step(tiny):
    sp = [SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=tuple(range(200, 220)))]
    one, _ = run(tiny, sp, steps=1, prompts=PROMPTS[:1])
    multi, ex = run(tiny, sp, steps=K, prompts=PROMPTS[:1])
    assert multi[0].token_ids == one[0].token_ids
    assert windows(ex) == 0


def test_window_records_count_every_step(tiny):
    _, ex = run(tiny, greedy((12,) * 2), steps=K, prompts=PROMPTS[:2])
    w = [r for r in ex.step_records if r.num_steps > 1]
    assert w and all(r.num_decode_tokens == r.batch_size * r.num_steps for r in w)
    assert sum(r.num_steps for r in ex.step_records) >= 12


def test_an_arrival_waits_at_most_one_window_for_its_first_token(tiny):
    """Admissions interleave at iteration boundaries: a request that arrives while a window
    of K = 8 steps runs is prefilled by the very next step, and its first token comes from
    that step (not after the long request's remaining windows)."""
    rt = make_runtime(tiny, steps=8)
    ex = Executor(rt)
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ex.enqueue_request(Request(prompt_token_ids=PROMPTS[1], sampling=long))
    runner, arrived = rt.runner, []

    def launch(batch, src_rows=None):
        pending = type(runner).launch(runner, batch, src_rows)
        if batch.window is not None and len(arrived) < 2 and len(ex.step_records) % 3 == 1:
            short = SamplingParams(max_new_tokens=3, ignore_eos=True)
            rid = ex.enqueue_request(Request(prompt_token_ids=PROMPTS[3], sampling=short))
            arrived.append((rid, len(ex.step_records)))  # the window in flight's record
        return pending

    runner.launch = launch
    ex.run_until_complete()
    assert len(arrived) == 2
    for rid, n in arrived:
        window, nxt = ex.step_records[n], ex.step_records[n + 1]
        assert window.num_steps == 8 and nxt.num_prefill_tokens > 0 and nxt.num_steps == 1
        first = ex.request_record(rid).first_token_time
        assert nxt.start_time <= first <= nxt.end_time
    assert rt.kv.num_free_blocks == rt.kv.total_blocks


@pytest.mark.parametrize("bad", [0, -1, 65, 2.5])
def test_bad_decode_steps_per_iteration_is_refused(bad):
    with pytest.raises(ConfigError, match="decode_steps_per_iteration"):
        RuntimeConfig(decode_steps_per_iteration=bad)
