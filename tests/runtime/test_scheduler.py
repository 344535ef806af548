"""Scheduler on a real KVCacheManager with a small pool: exact tokens, blocks and queues.

The model is faked by ``fake_token``: a deterministic function of the sequence's tokens, so a
preempted and recomputed request must produce exactly the tokens it would have without it.
"""

from __future__ import annotations

import logging

import pytest

from helpers.fakes import make_scheduler
from llmc.base.errors import ConfigError, RequestError
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.types import FinishReason, SamplingParams, ScheduledBatch, Sequence

EOS = 2


def make(
    num_blocks: int = 64,
    tpb: int = 4,
    max_num_tokens: int = 64,
    max_batch_size: int = 8,
    policy: str = "max_utilization",
    chunked: bool = True,
    max_seq_len: int = 128,
    max_input_len: int = 64,
    reuse: bool = True,
) -> Scheduler:
    return make_scheduler(
        num_blocks,
        policy=policy,
        eos=(EOS,),
        reuse=reuse,
        max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_input_len=max_input_len,
        tokens_per_block=tpb,
        enable_chunked_prefill=chunked,
    )


def mkseq(
    rid: int, prompt: int | list[int], max_new: int = 4, priority: int = 0, **sampling
) -> Sequence:
    tokens = [10 + rid * 1000 + i for i in range(prompt)] if isinstance(prompt, int) else prompt
    sp = SamplingParams(
        max_new_tokens=max_new, ignore_eos=sampling.pop("ignore_eos", True), **sampling
    )
    return Sequence(rid, tokens, sp, max_new, 0.0, priority=priority)


def fake_token(seq: Sequence) -> int:
    return 3 + (sum(seq.all_token_ids) * 7 + seq.num_tokens) % 97


def step(s: Scheduler, check=None) -> tuple[ScheduledBatch, list[Sequence]]:
    """One engine step; ``check(batch)`` runs between schedule and update."""
    batch = s.schedule()
    if check is not None:
        check(batch)
    sampled = [fake_token(x.seq) for x in batch.sequences if x.sample]
    finished = s.update(batch, sampled)
    s.kv.check_invariants()
    return batch, finished


def shape(batch: ScheduledBatch) -> list[tuple[int, int, int, bool]]:
    return [
        (x.seq.request_id, x.start_position, x.num_new_tokens, x.sample) for x in batch.sequences
    ]


def run_all(s: Scheduler, max_steps: int = 10_000) -> list[Sequence]:
    done: list[Sequence] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return done
        done += step(s)[1]
    raise AssertionError("workload did not finish")


def test_exact_chunked_schedule_budget_16() -> None:
    s = make(max_num_tokens=16, tpb=4)
    a, b = mkseq(0, 20, max_new=3), mkseq(1, 10, max_new=3)
    s.add(a)
    s.add(b)
    batch, _ = step(s)
    assert shape(batch) == [(0, 0, 16, False)]
    assert a.block_table == [0, 1, 2, 3] and (s.num_running, s.num_waiting) == (1, 1)
    batch, _ = step(s)  # a finishes its prompt (4), b is admitted with the rest (10 of 12)
    assert shape(batch) == [(0, 16, 4, True), (1, 0, 10, True)]
    assert a.block_table == [0, 1, 2, 3, 4] and b.block_table == [5, 6, 7]
    assert batch.num_prefill_tokens == 14 and batch.num_decode_tokens == 0
    batch, _ = step(s)
    assert shape(batch) == [(0, 20, 1, True), (1, 10, 1, True)]
    assert batch.num_decode_tokens == 2
    batch, fin = step(s)
    assert shape(batch) == [(0, 21, 1, True), (1, 11, 1, True)]
    assert [x.request_id for x in fin] == [0, 1]
    assert all(x.finish_reason is FinishReason.LENGTH and len(x.output_token_ids) == 3 for x in fin)
    assert s.kv.num_free_blocks == s.kv.total_blocks and not s.has_unfinished()


@pytest.mark.parametrize("budget", [1, 16, 64])
def test_chunked_prefill_budgets(budget: int) -> None:
    s = make(max_num_tokens=budget, tpb=4, num_blocks=64)
    prompts = [37, 5, 50]
    seqs = [mkseq(i, n, max_new=6) for i, n in enumerate(prompts)]
    for q in seqs:
        s.add(q)

    def check(batch: ScheduledBatch) -> None:
        assert 0 < batch.num_tokens <= budget
        for x in batch.sequences:
            assert x.num_new_tokens >= 1
            # Blocks cover exactly the tokens computed so far plus this step's: none ahead.
            assert len(x.seq.block_table) == -(-(x.start_position + x.num_new_tokens) // 4)
            assert x.sample == (x.start_position + x.num_new_tokens == x.seq.num_tokens)
        # Sequences that were running are served before newly admitted ones, decode-first.
        ids = [x.seq.request_id for x in batch.sequences]
        old = [i for i in ids if i in running_before]
        assert sorted(ids[: len(old)]) == sorted(old)
        decode_flags = [x.is_decode for x in batch.sequences]
        assert decode_flags == sorted(decode_flags, reverse=True)

    while s.has_unfinished():
        running_before = {q.request_id for q in s.running}
        step(s, check)
    for q, n in zip(seqs, prompts, strict=True):
        assert len(q.output_token_ids) == 6 and q.num_computed_tokens == n + 5
    st = s.stats()
    # Every prompt token and every decode token is scheduled once (no reuse: distinct prompts).
    assert st.num_scheduled_tokens == sum(prompts) + 3 * 5
    if budget == 1:
        assert st.num_steps == sum(prompts) + 3 * 5
    assert s.kv.num_free_blocks == s.kv.total_blocks


def test_decode_and_prefill_mix_in_one_step() -> None:
    s = make(max_num_tokens=8, tpb=4)
    s.add(mkseq(0, 3, max_new=10))
    step(s)
    s.add(mkseq(1, 20, max_new=2))
    batch, _ = step(s)
    assert shape(batch) == [(0, 3, 1, True), (1, 0, 7, False)]
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 7
    batch, _ = step(s)
    assert shape(batch) == [(0, 4, 1, True), (1, 7, 7, False)]


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    s = make(max_num_tokens=16, chunked=False, max_input_len=16)
    s.add(mkseq(0, 10, max_new=3))
    s.add(mkseq(1, 10, max_new=3))
    batch, _ = step(s)
    assert shape(batch) == [(0, 0, 10, True)]  # 6 tokens left: request 1 (10) waits whole
    batch, _ = step(s)
    assert shape(batch) == [(0, 10, 1, True), (1, 0, 10, True)]


def test_max_batch_size_limits_running() -> None:
    s = make(max_batch_size=2)
    seqs = [mkseq(i, 4, max_new=2 + i) for i in range(5)]
    for q in seqs:
        s.add(q)
    batch, _ = step(s)
    assert [x.seq.request_id for x in batch.sequences] == [0, 1]
    assert (s.num_running, s.num_waiting) == (2, 3)
    _, fin = step(s)
    assert [x.request_id for x in fin] == [0]
    batch, _ = step(s)  # request 2 takes the freed place
    assert shape(batch) == [(1, 5, 1, True), (2, 0, 4, True)]
    while s.has_unfinished():
        batch, _ = step(s)
        assert len(batch.sequences) <= 2 and s.num_running <= 2
    assert [len(q.output_token_ids) for q in seqs] == [2, 3, 4, 5, 6]


def test_priority_overtakes_and_arrival_order_within_priority() -> None:
    s = make(max_batch_size=1)
    s.add(mkseq(0, 4, max_new=2))
    step(s)  # 0 runs
    s.add(mkseq(1, 4, max_new=1))
    s.add(mkseq(2, 4, max_new=1))
    s.add(mkseq(3, 4, max_new=1, priority=5))
    s.add(mkseq(4, 4, max_new=1, priority=5))
    assert [q.request_id for q in s.waiting()] == [3, 4, 1, 2]
    order = [q.request_id for q in run_all(s)]
    assert order == [0, 3, 4, 1, 2]


def test_guaranteed_no_evict_reserves_whole_life() -> None:
    # 8 blocks of 4 tokens. a: 10 + 12 - 1 = 21 cached tokens -> 6 blocks for its life.
    s = make(num_blocks=8, tpb=4, policy="guaranteed_no_evict")
    a, b = mkseq(0, 10, max_new=12), mkseq(1, 4, max_new=6)
    s.add(a)
    s.add(b)
    batch, _ = step(s)
    # b's prompt would fit now (1 block) but its life needs 3 blocks and only 8 - 6 are left.
    assert shape(batch) == [(0, 0, 10, True)]
    assert a.block_table == [0, 1, 2] and s.num_waiting == 1
    while s.num_waiting:
        step(s)
        assert s.stats().num_preemptions == 0
        reserved = sum(
            s.kv.blocks_for_tokens(q.num_prompt_tokens + q.max_new_tokens - 1) - len(q.block_table)
            for q in s.running
        )
        assert s.kv.num_used_blocks + reserved <= s.kv.total_blocks
    assert a.is_finished  # b was admitted only once a had finished
    run_all(s)
    assert len(b.output_token_ids) == 6 and s.stats().num_preemptions == 0


def _solo_output(prompt: int, max_new: int) -> list[int]:
    s = make(num_blocks=64)
    q = mkseq(1, prompt, max_new=max_new)
    s.add(q)
    run_all(s)
    return q.output_token_ids


def test_max_utilization_preempts_newest_and_it_completes_identically(caplog) -> None:
    s = make(num_blocks=6, tpb=4, max_num_tokens=32, policy="max_utilization", reuse=False)
    a, b = mkseq(0, 8, max_new=12), mkseq(1, 8, max_new=10)
    s.add(a)
    s.add(b)
    caplog.set_level(logging.INFO, logger="llmc.scheduler")
    batch, _ = step(s)
    assert shape(batch) == [(0, 0, 8, True), (1, 0, 8, True)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    preempted_at = None
    for _ in range(40):
        batch, _ = step(s)
        if batch.preempted_request_ids:
            preempted_at = batch
            break
    assert preempted_at is not None and preempted_at.preempted_request_ids == (1,)
    assert [x.seq.request_id for x in preempted_at.sequences] == [0]
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0 and b.block_table == []
    assert s.num_waiting == 1 and s.stats().num_preemptions == 1
    assert "preempted request 1" in caplog.text
    kept = len(b.output_token_ids)
    assert kept > 0
    run_all(s)
    assert a.num_preemptions == 0
    assert len(b.output_token_ids) == 10 and b.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == _solo_output(8, 10)
    assert s.kv.num_free_blocks == s.kv.total_blocks


def test_newest_preempts_itself_when_it_is_the_one_short() -> None:
    s = make(num_blocks=3, tpb=4, policy="max_utilization", reuse=False)
    a, b = mkseq(0, 7, max_new=6), mkseq(1, 4, max_new=6)
    s.add(a)
    s.add(b)
    step(s)  # a: 2 blocks, b: the last one; b's decode at position 4 needs one more
    batch, _ = step(s)
    assert shape(batch) == [(0, 7, 1, True)] and batch.preempted_request_ids == (1,)
    run_all(s)
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make(num_blocks=5, tpb=4, max_batch_size=2, policy="max_utilization", reuse=False)
    a, b = mkseq(0, 8, max_new=12), mkseq(1, 4, max_new=8)
    s.add(a)
    s.add(b)
    step(s)
    c = mkseq(2, 2, max_new=1, priority=1)  # waits: the batch is full
    s.add(c)
    for _ in range(10):
        batch, _ = step(s)
        if batch.preempted_request_ids:
            break
    assert batch.preempted_request_ids == (1,)
    assert shape(batch) == [(0, 12, 1, True)]  # room for c now, but memory is tight: wait
    assert [q.request_id for q in s.waiting()] == [2, 1]
    batch, _ = step(s)
    assert shape(batch) == [(0, 13, 1, True), (2, 0, 2, True)]
    run_all(s)
    assert [len(q.output_token_ids) for q in (a, b, c)] == [12, 8, 1]


def test_prefix_reuse_through_the_scheduler() -> None:
    s = make(num_blocks=32, tpb=4)
    shared = list(range(100, 112))  # 3 full blocks
    a = mkseq(0, shared + [1, 2], max_new=4)
    s.add(a)
    step(s)
    b, c = mkseq(1, shared + [5, 6, 7], max_new=2), mkseq(2, list(shared), max_new=2)
    s.add(b)
    s.add(c)
    batch, _ = step(s)
    assert shape(batch) == [(0, 14, 1, True), (1, 12, 3, True), (2, 8, 4, True)]
    assert b.num_cached_tokens == 12 and c.num_cached_tokens == 8  # c: the all-cached prompt
    assert b.block_table[:3] == a.block_table[:3] and c.block_table[:2] == a.block_table[:2]
    assert c.block_table[2] not in a.block_table
    assert [s.kv.ref_count(x) for x in a.block_table[:3]] == [3, 3, 2]
    kvs = s.kv.stats()
    assert (kvs.reuse_hits, kvs.reuse_misses) == (3 + 2, 3 + 0 + 0)
    run_all(s)
    assert s.kv.num_free_blocks == s.kv.total_blocks


def test_eos_stop_ids_and_length() -> None:
    s = make()
    q = mkseq(0, 3, max_new=50, ignore_eos=False)
    s.add(q)
    batch = s.schedule()
    assert s.update(batch, [EOS]) == [q] and q.finish_reason is FinishReason.STOP
    assert q.output_token_ids == [EOS]
    r = mkseq(1, 3, max_new=50, stop_token_ids=(77,))
    s.add(r)
    s.update(s.schedule(), [EOS])  # ignore_eos
    assert s.update(s.schedule(), [77]) == [r] and r.finish_reason is FinishReason.STOP
    with pytest.raises(ValueError, match="sampled 0 sequences but 1 token ids"):
        s.update(ScheduledBatch(step_id=9, sequences=()), [1])
    assert s.kv.num_free_blocks == s.kv.total_blocks


def test_finish_frees_waiting_running_and_in_flight() -> None:
    s = make(max_batch_size=1)
    a, b = mkseq(0, 9, max_new=8), mkseq(1, 9, max_new=8)
    s.add(a)
    s.add(b)
    step(s)
    assert s.finish(1, FinishReason.CANCELLED) is b and b.finish_reason is FinishReason.CANCELLED
    batch = s.schedule()
    assert s.finish(0, FinishReason.CANCELLED) is a  # between schedule and update
    assert s.update(batch, [5]) == [] and len(a.output_token_ids) == 1  # 5 is dropped
    assert a.num_computed_tokens == 9 and a.block_table == []
    assert s.finish(0, FinishReason.CANCELLED) is None and not s.has_unfinished()
    assert s.kv.num_free_blocks == s.kv.total_blocks


def test_bad_requests_raise_with_numbers_and_others_continue() -> None:
    s = make(num_blocks=12, tpb=4, max_seq_len=48, max_input_len=32)
    good = mkseq(0, 5, max_new=3)
    s.add(good)
    with pytest.raises(RequestError, match="request 1: the prompt is empty"):
        s.add(mkseq(1, []))
    with pytest.raises(RequestError, match="request 2: prompt has 33 tokens.*max_input_len=32"):
        s.add(mkseq(2, 33))
    with pytest.raises(
        RequestError,
        match=r"request 3: prompt \(30 tokens\) \+ max_new_tokens "
        r"\(20\) = 50 exceeds the engine's max_seq_len=48",
    ):
        s.add(mkseq(3, 30, max_new=20))
    clamped = mkseq(4, 30, max_new=20, clamp_max_new_tokens=True)
    s.add(clamped)
    assert clamped.max_new_tokens == 18
    small = make(num_blocks=10, tpb=4, max_seq_len=48, max_input_len=32)
    with pytest.raises(RequestError, match=r"request 5: needs 11 KV-cache blocks .* has 10"):
        small.add(mkseq(5, 30, max_new=15))  # 44 cached tokens -> 11 blocks of 4
    with pytest.raises(RequestError, match="request 0: a request with this id"):
        s.add(mkseq(0, 5))
    run_all(s)
    assert len(good.output_token_ids) == 3 and len(clamped.output_token_ids) == 18


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="guaranteed_no_evict, max_utilization"):
        make(policy="fcfs")
    with pytest.raises(ConfigError, match="max_input_len \\(64\\) must not exceed"):
        make(max_seq_len=32)
    with pytest.raises(ConfigError, match="chunked prefill off"):
        make(chunked=False, max_num_tokens=16)
    with pytest.raises(ConfigError, match="tokens_per_block \\(4\\) differs"):
        Scheduler(make().config, KVCacheManager(8, 16))


def _run_with_ahead(s: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> int:
    """Drive ``s`` as the async executor does: while step N is "on the device", schedule step
    N + 1 with ``schedule_ahead``; each step's tokens are computed when it completes. Returns
    how many steps were scheduled ahead."""
    for q in seqs:
        s.add(q)
    cur, ahead_steps = s.schedule(), 0
    for _ in range(max_steps):
        if cur.is_empty and not s.has_unfinished():
            return ahead_steps
        ahead = s.schedule_ahead(cur) if not cur.is_empty else None
        for x in ahead.sequences if ahead is not None else ():  # its KV slot has a block
            assert x.start_position < len(x.seq.block_table) * s.kv.tokens_per_block
        s.update(cur, [fake_token(x.seq) for x in cur.sequences if x.sample])
        s.kv.check_invariants()
        if ahead is not None:
            ahead_steps += 1
            cur = ahead
        else:
            cur = s.schedule()
    raise AssertionError("workload did not finish")


@pytest.mark.parametrize("vector", [False, True], ids=["per-row", "over-slots"])
@pytest.mark.parametrize("case", ["same_lengths", "staggered"])
def test_schedule_ahead_gives_the_synchronous_tokens(case: str, vector: bool, monkeypatch) -> None:
    """Steps scheduled ahead (one pass over the running set; a zip fast path when the previous
    step sampled exactly the running sequences in order, a lookup otherwise; or over the slot
    arrays) produce the same tokens as the synchronous loop, and some steps really are
    scheduled ahead."""
    monkeypatch.setattr(Scheduler, "vector_rows", 1 if vector else 1 << 30)
    if case == "same_lengths":
        specs = [(6, 9)] * 5
        kw: dict = {}
    else:  # admissions while others decode, chunked prompts, a full batch, block boundaries
        specs = [(3, 7), (17, 5), (6, 12), (30, 3), (5, 9), (9, 8), (2, 11)]
        kw = {"max_batch_size": 4, "max_num_tokens": 16}

    def seqs() -> list[Sequence]:
        return [mkseq(i, p, max_new=n) for i, (p, n) in enumerate(specs)]

    sync = make(**kw)
    for q in seqs():
        sync.add(q)
    want = {q.request_id: q.output_token_ids for q in run_all(sync)}
    s = make(**kw)
    got_seqs = seqs()
    ahead_steps = _run_with_ahead(s, got_seqs)
    assert {q.request_id: q.output_token_ids for q in got_seqs} == want
    assert ahead_steps > 0
    assert s.kv.num_free_blocks == s.kv.total_blocks


@pytest.mark.parametrize("vector", [False, True], ids=["per-row", "over-slots"])
def test_schedule_ahead_changes_nothing_when_blocks_run_out(vector: bool, monkeypatch) -> None:
    """The next token needs a new block for every row and the pool cannot give them: None,
    and no block table grew."""
    monkeypatch.setattr(Scheduler, "vector_rows", 1 if vector else 1 << 30)
    s = make(num_blocks=3, tpb=4, max_batch_size=2)
    a, b = mkseq(0, 3, max_new=8), mkseq(1, 3, max_new=8)
    s.add(a)
    s.add(b)
    batch, _ = step(s)  # prefill of both: 3 tokens each, one block each
    assert [len(a.block_table), len(b.block_table)] == [1, 1]
    batch = s.schedule()  # decode: positions 3 -> still in block 0
    tables = [list(a.block_table), list(b.block_table)]
    assert s.schedule_ahead(batch) is None  # positions 4 need a second block each: none free
    assert [a.block_table, b.block_table] == tables


def test_sequences_compare_by_identity() -> None:
    """One Sequence per request: equal fields do not make two requests equal, so removing a
    finished sequence from the running list never compares the fields of the others."""
    a, b = mkseq(7, 5), mkseq(7, 5)
    assert a != b and a == a
    assert len({a, b}) == 2
    running = [b, a]
    running.remove(a)
    assert running == [b] and running[0] is b
