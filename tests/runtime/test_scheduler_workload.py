"""Random workloads through Scheduler + KVCacheManager, checked after every step.

The fake model reads its input back from a simulated KV cache: each step writes every
scheduled token into the slot its block table gives, then a sampled token is a function of the
tokens *read from the cache* at positions 0..last. A wrong block table, a shared block written
by another sequence, a reused block whose content was evicted, or a bad re-prefill after
preemption all change the tokens, which are compared with a direct simulation.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from helpers.fakes import make_scheduler
from llmc.base.errors import RequestError
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.types import FinishReason, SamplingParams, ScheduledBatch, Sequence

STEMS = [[5] * 40, [5] * 12 + [6] * 28, [7, 8] * 20, [5] * 4 + [9] * 36]


def fake_model(history: list[int]) -> int:
    return 3 + (sum(history) * 7 + len(history) * 3) % 11


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_model(tokens))
    return tokens[len(prompt) :]


request_st = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(0, len(STEMS) - 1),  # stem
    st.integers(1, 40),  # prompt length
    st.integers(1, 24),  # max_new_tokens
    st.integers(0, 2),  # priority
    # cancel: (only when 0, i.e. ~20%, steps after arrival, during a step or between steps)
    st.tuples(st.integers(0, 4), st.integers(0, 30), st.booleans()),
)


def run_step(s: Scheduler, cache: dict[int, int], cancel_in_flight: int | None) -> ScheduledBatch:
    kv = s.kv
    batch = s.schedule()
    seen: set[int] = set()
    for x in batch.sequences:
        seq = x.seq
        assert seq.request_id not in seen
        seen.add(seq.request_id)
        assert x.start_position == seq.num_computed_tokens
        for p in range(x.start_position, x.start_position + x.num_new_tokens):
            block = seq.block_table[p // kv.tokens_per_block]
            assert kv.ref_count(block) == 1, f"request {seq.request_id} writes shared block"
            cache[kv.slot(seq, p)] = seq.token_at(p)
    sampled = []
    for x in batch.sequences:
        if x.sample:
            end = x.start_position + x.num_new_tokens
            sampled.append(
                fake_model(
                    [
                        cache[
                            x.seq.block_table[p // kv.tokens_per_block] * kv.tokens_per_block
                            + p % kv.tokens_per_block
                        ]
                        for p in range(end)
                    ]
                )
            )
    if cancel_in_flight is not None:
        s.finish(cancel_in_flight, FinishReason.CANCELLED)
    s.update(batch, sampled)
    return batch


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request_st, min_size=2, max_size=20),
    policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
    tpb=st.sampled_from([1, 2, 4, 8]),
    pool_tokens=st.integers(48, 128),
    budget=st.integers(1, 64),
    max_batch_size=st.integers(1, 8),
    chunked=st.booleans(),
    reuse=st.sampled_from([True, True, False]),
)
def test_random_workload_invariants(
    requests, policy, tpb, pool_tokens, budget, max_batch_size, chunked, reuse
) -> None:
    max_seq_len = 56
    max_input_len = 40 if chunked else min(40, budget)
    s = make_scheduler(
        max(1, pool_tokens // tpb),
        policy=policy,
        reuse=reuse,
        max_num_tokens=budget,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_input_len=max_input_len,
        tokens_per_block=tpb,
        enable_chunked_prefill=chunked,
    )
    kv = s.kv
    seqs: dict[int, Sequence] = {}
    cancels: dict[int, tuple[int, bool]] = {}
    cache: dict[int, int] = {}
    step = 0
    while step < 3000:
        for rid, (arrive, stem, n, max_new, prio, cancel) in enumerate(requests):
            if arrive != step:
                continue
            prompt = STEMS[stem][:n]
            seq = Sequence(
                rid, prompt, SamplingParams(max_new, ignore_eos=True), max_new, 0.0, priority=prio
            )
            life = kv.blocks_for_tokens(n + max_new - 1)
            try:
                s.add(seq)
            except RequestError as e:
                assert n > max_input_len or n + max_new > max_seq_len or life > kv.total_blocks
                assert f"request {rid}" in str(e)
                continue
            seqs[rid] = seq
            if cancel[0] == 0:
                cancels[rid] = (arrive + cancel[1], cancel[2])
        for rid, (at, in_flight) in cancels.items():
            if at == step and not in_flight:
                s.finish(rid, FinishReason.CANCELLED)
        if not s.has_unfinished():
            if step > 6:
                break
            step += 1
            continue
        in_flight = next((r for r, (at, fl) in cancels.items() if at == step and fl), None)
        batch = run_step(s, cache, in_flight)
        assert not batch.is_empty, "no progress although requests are unfinished"
        assert batch.num_tokens <= budget and len(batch.sequences) <= max_batch_size
        assert s.num_running <= max_batch_size
        kv.check_invariants()
        live = s.running
        for b in range(kv.total_blocks):
            assert kv.ref_count(b) == sum(q.block_table.count(b) for q in live)
        assert all(not q.block_table for q in s.waiting())
        if policy == "guaranteed_no_evict":
            assert not batch.preempted_request_ids
            promised = sum(
                kv.blocks_for_tokens(q.num_prompt_tokens + q.max_new_tokens - 1)
                - len(q.block_table)
                for q in live
            )
            assert kv.num_used_blocks + promised <= kv.total_blocks
        step += 1
    assert not s.has_unfinished(), "workload did not finish (livelock?)"
    assert kv.num_free_blocks == kv.total_blocks
    for rid, seq in seqs.items():
        if seq.finish_reason is FinishReason.CANCELLED:
            assert len(seq.output_token_ids) <= seq.max_new_tokens
            assert rid in cancels
            continue
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, seq.max_new_tokens)
    if policy == "guaranteed_no_evict":
        assert s.stats().num_preemptions == 0
    event(f"preempted: {s.stats().num_preemptions > 0}")
    event(f"reuse hits: {kv.stats().reuse_hits > 0}")
    event(f"cancelled: {any(q.finish_reason is FinishReason.CANCELLED for q in seqs.values())}")
