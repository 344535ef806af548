"""Load test: 2,000 requests of random lengths through the Executor on a tiny real engine.

Every request ends with exactly its expected number of tokens (ignore_eos), the 10% that
are cancelled mid-stream end with reason cancelled, the stream of each adds up to its final
response, and every KV block is free again at the end."""

from __future__ import annotations

import random

import pytest

from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import FinishReason, Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_REQUESTS = 2000


@pytest.fixture(scope="module")
def load_engine_dir(tiny_engine, tiny_llama_dir):
    # 128 sequences of up to 48 tokens in flight, a pool of 48 × 48 tokens (below)
    return tiny_engine(
        tiny_llama_dir, max_seq_len=48, max_batch_size=128, max_num_tokens=512, tokens_per_block=8
    )


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_two_thousand_requests_with_cancellations(load_engine_dir, policy):
    rt = EngineRuntime.load(
        load_engine_dir, RuntimeConfig(scheduler_policy=policy, max_kv_tokens=48 * 48)
    )
    ex = rt.executor()
    rng = random.Random(7)
    expected: dict[int, int] = {}
    to_cancel: set[int] = set()
    for _ in range(NUM_REQUESTS):  # both policies, as docs/RUNTIME.md says
        n_prompt, n_new = rng.randint(1, 24), rng.randint(1, 16)
        prompt = [rng.randrange(3, 256) for _ in range(n_prompt)]
        rid = ex.enqueue_request(
            Request(
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_new_tokens=n_new, ignore_eos=True),
                streaming=True,
            )
        )
        expected[rid] = n_new
        if n_new >= 4 and rng.random() < 0.1 / 0.8:  # ~10% of all requests
            to_cancel.add(rid)
    streamed: dict[int, list[int]] = {rid: [] for rid in expected}
    finals = {}
    while len(finals) < len(expected):
        for r in ex.await_responses():
            assert r.request_id not in finals, "a response after the final one"
            streamed[r.request_id] += r.new_token_ids
            if r.is_final:
                finals[r.request_id] = r
            elif r.request_id in to_cancel:
                assert ex.cancel_request(r.request_id)
    assert 0.07 < len(to_cancel) / len(expected) < 0.13
    for rid, n_new in expected.items():
        final = finals[rid]
        assert streamed[rid] == final.token_ids
        if rid in to_cancel:
            assert final.finish_reason is FinishReason.CANCELLED
            assert 1 <= len(final.token_ids) < n_new
        else:
            assert final.finish_reason is FinishReason.LENGTH, final.error
            assert len(final.token_ids) == n_new
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks and stats.used_blocks == 0
    rt.kv.check_invariants()
    assert not rt.scheduler.has_unfinished()
    assert max(s.batch_size for s in ex.step_records) > 32  # really in flight together
    records = ex.request_records
    assert len(records) == len(expected)
    assert all(r.num_output_tokens == len(finals[r.request_id].token_ids) for r in records)
    if policy == "max_utilization":
        assert sum(s.num_preempted for s in ex.step_records) > 0
