"""Executor lifecycle on a real Scheduler + KVCacheManager with a model-free runner:
streaming invariants, bad requests (each fails alone), cancellation, stop strings and EOS,
records, and the background loop."""

from __future__ import annotations

import re
import threading

import pytest

from helpers.fakes import fake_parts
from llmc.base.errors import RequestError
from llmc.runtime.executor import Executor
from llmc.runtime.types import FinishReason, Request, SamplingParams


def ids_request(ids, n=8, streaming=True, **sp) -> Request:
    return Request(
        prompt_token_ids=list(ids),
        sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, **sp),
        streaming=streaming,
    )


def drain(ex: Executor, ids=None) -> dict[int, list]:
    by_id: dict[int, list] = {}
    while True:
        got = ex.await_responses(ids)
        if not got:
            return by_id
        for r in got:
            by_id.setdefault(r.request_id, []).append(r)


def assert_stream_consistent(responses) -> None:
    finals = [r for r in responses if r.is_final]
    assert len(finals) == 1 and responses[-1].is_final
    final = finals[0]
    assert [t for r in responses for t in r.new_token_ids] == final.token_ids
    assert "".join(r.new_text for r in responses) == final.text


def test_streaming_deltas_add_up_and_every_request_ends_once(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok))
    ids = [ex.enqueue_request(ids_request(range(3, 3 + k), n=5 + k)) for k in range(1, 12)]
    ids.append(ex.enqueue_request(Request(prompt="hello", sampling=SamplingParams(4))))
    got = drain(ex)
    assert sorted(got) == ids
    for rid, responses in got.items():
        assert_stream_consistent(responses)
        if rid != ids[-1]:
            assert len(responses) >= 2  # streamed
            assert len(responses[-1].token_ids) == 5 + rid + 1
            assert responses[-1].finish_reason is FinishReason.LENGTH
    assert len(got[ids[-1]]) == 1  # not streaming: one final response with everything
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks and stats.peak_used_blocks > 0


def test_generate_matches_scripted_tokens_and_text(tiny_tok):
    hello = tiny_tok.encode("Hello, world", add_special_tokens=False)
    ex = Executor(fake_parts(tokenizer=tiny_tok, script={0: hello}))
    [out] = ex.generate(["prompt"], SamplingParams(max_new_tokens=len(hello), ignore_eos=True))
    assert out.ok and out.token_ids == hello and out.text == "Hello, world"
    assert out.finish_reason is FinishReason.LENGTH
    assert out.prompt_token_ids == tiny_tok.encode("prompt")


def test_eos_finishes_with_stop_and_has_no_text(tiny_tok):
    script = tiny_tok.encode("ab", add_special_tokens=False) + [2, 5, 5]
    ex = Executor(fake_parts(tokenizer=tiny_tok, script={0: script, 1: script}))
    a, b = ex.generate([[7, 8], [7, 8]], [SamplingParams(10), SamplingParams(5, ignore_eos=True)])
    assert a.finish_reason is FinishReason.STOP and a.token_ids == script[:3] and a.text == "ab"
    assert b.finish_reason is FinishReason.LENGTH and b.token_ids == script[:5]


def test_stop_token_ids_finish_with_stop(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok, script={0: [40, 41, 42, 43]}))
    [out] = ex.generate([[9]], SamplingParams(10, stop_token_ids=(42,)))
    assert out.token_ids == [40, 41, 42] and out.finish_reason is FinishReason.STOP
    assert out.text == tiny_tok.decode([40, 41])


def test_stop_string_cuts_text_and_frees_blocks(tiny_tok):
    script = tiny_tok.encode("one two STOP three four", add_special_tokens=False)
    ex = Executor(fake_parts(tokenizer=tiny_tok, script={0: script}))
    rid = ex.enqueue_request(
        Request(prompt_token_ids=[5], sampling=SamplingParams(40, stop=("STOP",)), streaming=True)
    )
    responses = drain(ex)[rid]
    assert_stream_consistent(responses)
    final = responses[-1]
    assert final.finish_reason is FinishReason.STOP and final.text == "one two "
    assert len(final.token_ids) == len(tiny_tok.encode("one two STOP", add_special_tokens=False))
    assert ex.kv_stats().free_blocks == ex.kv_stats().total_blocks


def _changed(request: Request, **fields) -> Request:
    """A Request made valid, then changed (it is mutable): the Executor checks it again."""
    for name, value in fields.items():
        setattr(request, name, value)
    return request


BAD_REQUESTS = [
    (Request(prompt_token_ids=[]), "the prompt is empty"),
    (Request(prompt=""), "the prompt is empty"),
    (Request(), "the prompt is empty"),
    (Request(prompt_token_ids=[1, 256]), "prompt token id 256 is outside the vocabulary [0, 256)"),
    (Request(prompt_token_ids=[1, -1]), "prompt token id -1 is outside the vocabulary"),
    (_changed(Request(prompt="x"), prompt_token_ids=[1]), "as text or as token ids, not both"),
    (_changed(Request(prompt="x"), prompt=7), "request field prompt=7: must be a string"),
    (
        Request(prompt_token_ids=[1] * 49),
        "prompt has 49 tokens, more than the engine's max_input_len=48",
    ),
    (
        Request(prompt_token_ids=[1] * 40, sampling=SamplingParams(max_new_tokens=30)),
        "= 70 exceeds the engine's max_seq_len=64",
    ),
]


@pytest.mark.parametrize(("request_", "message"), BAD_REQUESTS)
def test_bad_request_fails_alone(tiny_tok, request_, message):
    ex = Executor(fake_parts(tokenizer=tiny_tok))
    good1 = ex.enqueue_request(ids_request([5, 6, 7], n=6))
    bad = ex.enqueue_request(request_)
    first = ex.await_responses(bad, timeout=0)  # immediate, before any step
    assert len(first) == 1 and first[0].is_final
    assert first[0].finish_reason is FinishReason.ERROR
    assert message in first[0].error, first[0].error
    assert f"request {bad}" in first[0].error
    assert first[0].error_code == RequestError.exit_code
    good2 = ex.enqueue_request(ids_request([8, 9], n=7))
    got = drain(ex)
    assert len(got[good1][-1].token_ids) == 6 and len(got[good2][-1].token_ids) == 7
    assert bad not in got
    rec = {r.request_id: r for r in ex.request_records}[bad]
    assert rec.finish_reason == "error" and message in rec.error


def test_clamp_max_new_tokens_when_asked(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok))
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True, clamp_max_new_tokens=True)
    [out] = ex.generate([[1] * 40], sp)
    assert out.ok and len(out.token_ids) == 64 - 40 and out.finish_reason is FinishReason.LENGTH


def test_request_that_can_never_fit_fails_fast(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok, num_blocks=4, policy="max_utilization"))
    ok, never = ex.generate([[3] * 5, [3] * 12], SamplingParams(8, ignore_eos=True))
    assert ok.ok and len(ok.token_ids) == 8
    assert never.finish_reason is FinishReason.ERROR
    assert "needs 5 KV-cache blocks" in never.error and "the whole pool has 4" in never.error


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), "temperature=-0.5: must be a finite number in [0, "),
        (dict(top_p=0.0), "top_p=0.0: must be a finite number in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5: must be a finite number in (0, 1]"),
        (dict(top_k=-2), "top_k=-2: must be an integer in [0, 2147483647]"),  # -1: vLLM off
        (dict(max_new_tokens=0), "max_new_tokens=0: must be an integer in [1, 2147483647]"),
    ],
)
def test_invalid_sampling_values_are_refused_with_the_field(kwargs, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_text_prompt_and_stop_strings_need_a_tokenizer():
    ex = Executor(fake_parts(tokenizer=None))
    a = ex.enqueue_request(Request(prompt="hi"))
    b = ex.enqueue_request(Request(prompt_token_ids=[4], sampling=SamplingParams(stop=("x",))))
    c = ex.enqueue_request(ids_request([4, 5], n=3))
    got = drain(ex)
    assert "no tokenizer" in got[a][0].error and "stop strings need a tokenizer" in got[b][0].error
    assert got[c][-1].token_ids and len(got[c][-1].token_ids) == 3 and got[c][-1].text == ""


def test_cancel_running_and_waiting_requests_frees_blocks(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok, max_batch_size=2))
    running = [ex.enqueue_request(ids_request([3] * 6, n=30)) for _ in range(2)]
    waiting = ex.enqueue_request(ids_request([4] * 6, n=30))
    ex.step()
    ex.step()
    assert ex.kv_stats().used_blocks > 0
    assert ex.cancel_request(running[0]) and ex.cancel_request(waiting)
    assert not ex.cancel_request(999)
    got = drain(ex)
    for rid in (running[0], waiting):
        assert_stream_consistent(got[rid])
        assert got[rid][-1].finish_reason is FinishReason.CANCELLED
    assert len(got[waiting][-1].token_ids) == 0
    assert 0 < len(got[running[0]][-1].token_ids) < 30
    assert len(got[running[1]][-1].token_ids) == 30
    assert not ex.cancel_request(running[1])  # already finished
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks
    ex.scheduler.kv.check_invariants()


def test_records_follow_each_request_and_step(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok, max_num_tokens=8))
    outs = ex.generate([[5] * 10, [6] * 3], SamplingParams(6, ignore_eos=True))
    for out in outs:
        r = out.record
        assert r.arrival_time <= r.scheduled_time <= r.first_token_time <= r.finish_time
        assert len(r.token_times) == r.num_output_tokens == 6
        assert r.token_times == sorted(r.token_times) and r.token_times[0] == r.first_token_time
        assert r.finish_reason == "length" and r.num_prompt_tokens == len(out.prompt_token_ids)
    steps = ex.step_records
    assert [s.step_id for s in steps] == list(range(len(steps)))
    assert sum(s.num_prefill_tokens for s in steps) == 13  # chunked over 8-token steps
    assert all(s.num_tokens <= 8 and 0 < s.kv_blocks_used <= s.kv_blocks_total for s in steps)
    assert all({"schedule", "forward", "update"} <= set(s.phase_times) for s in steps)
    assert sum(s.num_decode_tokens for s in steps) == 2 * 5


def test_background_loop_serves_many_threads(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok)).start()
    results: dict[int, list] = {}
    lock = threading.Lock()

    def client(k: int) -> None:
        rids = [ex.enqueue_request(ids_request([3 + k, 4 + j], n=3 + j)) for j in range(5)]
        got = drain(ex, rids)
        with lock:
            results.update(got)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    ex.shutdown()
    assert len(results) == 20
    for responses in results.values():
        assert_stream_consistent(responses)
    assert ex.kv_stats().free_blocks == ex.kv_stats().total_blocks


def test_await_with_timeout_returns_empty_when_nothing_is_ready(tiny_tok):
    ex = Executor(fake_parts(tokenizer=tiny_tok)).start()
    try:
        assert ex.await_responses(timeout=0.01) == []
        rid = ex.enqueue_request(ids_request([3], n=2, streaming=False))
        got = []
        while not got:
            got = ex.await_responses(rid, timeout=5)
        assert got[0].is_final and len(got[0].token_ids) == 2
    finally:
        ex.shutdown()


def test_preemption_by_recompute_keeps_outputs_identical(tiny_tok):
    prompts = [[3 + i] * (5 + i) for i in range(6)]
    sp = SamplingParams(20, ignore_eos=True)
    roomy = Executor(fake_parts(tokenizer=tiny_tok, num_blocks=64)).generate(prompts, sp)
    tight_ex = Executor(fake_parts(tokenizer=tiny_tok, num_blocks=12, policy="max_utilization"))
    tight = tight_ex.generate(prompts, sp)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert sum(s.num_preempted for s in tight_ex.step_records) > 0
    assert sum(o.record.num_preemptions for o in tight) > 0
    assert tight_ex.kv_stats().free_blocks == 12


def test_background_loop_failure_fails_open_requests_and_refuses_new_ones(tiny_tok):
    from llmc.base.errors import EngineError

    parts = fake_parts(tokenizer=tiny_tok)

    def broken(batch):
        raise RuntimeError("device lost")

    parts.runner.step = broken
    ex = Executor(parts).start()
    rid = ex.enqueue_request(ids_request([3, 4], n=4))
    got = drain(ex, [rid])
    final = got[rid][-1]
    assert final.is_final and final.finish_reason is FinishReason.ERROR
    assert "engine failure" in final.error and "device lost" in final.error
    with pytest.raises(EngineError, match="the engine loop failed and stopped"):
        ex.enqueue_request(ids_request([3], n=1))
    ex.shutdown()


def test_response_sink_gets_each_steps_responses_from_the_loop_thread(tiny_tok):
    """With a sink, the loop thread hands over every Response (a step's in one call, an
    enqueue refusal too) before the next step; await_responses sees none; unset, it does."""
    ex = Executor(fake_parts(tokenizer=tiny_tok)).start()
    calls: list[tuple[str, list]] = []
    done = threading.Event()

    def sink(batch) -> None:
        calls.append((threading.current_thread().name, batch))
        if sum(r.is_final for _, b in calls for r in b) == 3:
            done.set()

    try:
        ex.set_response_sink(sink)
        ids = [ex.enqueue_request(ids_request([3, 4, 5], n=4)) for _ in range(2)]
        bad = ex.enqueue_request(ids_request([999_999], n=4))  # outside the vocabulary
        assert done.wait(10.0)
        assert {name for name, _ in calls} == {"llmc-executor"}
        got: dict[int, list] = {}
        for _, batch in calls:
            assert len({r.request_id for r in batch}) == len(batch)  # one step: one each
            for r in batch:
                got.setdefault(r.request_id, []).append(r)
        assert sorted(got) == sorted([*ids, bad])
        for rid in ids:
            assert_stream_consistent(got[rid])
            assert len(got[rid][-1].token_ids) == 4
        assert got[bad][0].error is not None
        assert ex.await_responses(timeout=0.05) == []
        ex.set_response_sink(None)
        rid = ex.enqueue_request(ids_request([3], n=2))
        assert_stream_consistent(drain(ex, [rid])[rid])
    finally:
        ex.shutdown()
