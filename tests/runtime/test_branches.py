"""Requests with several sequences on the engine core without a model (a real Scheduler and
KVCacheManager, the FakeRunner): n / best_of samples prefill once and fork at their first
token, share the prompt's blocks (refcounts) and copy the partial last block on write; beams
run in lockstep; every block is free again after they finish, are cancelled, fail or were
preempted; the rules of the new SamplingParams fields and of admission."""

from __future__ import annotations

import pytest

from helpers.fakes import TOKENS_PER_BLOCK, FakeRunner, fake_parts, make_scheduler
from llmc.base.errors import RequestError
from llmc.runtime.executor import Executor
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.types import (
    FinishReason,
    Request,
    RequestFault,
    SamplingParams,
    Sequence,
)


def sampled(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 6), temperature=1.0,
                          seed=kw.pop("seed", 5), n=n, ignore_eos=True, **kw)  # fmt: skip


def beams(k: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 6), use_beam_search=True,
                          beam_width=k, n=kw.pop("n", k), **kw)  # fmt: skip


def assert_pool_free(ex: Executor) -> None:
    kv = ex.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.total_blocks


def checked_run(ex: Executor) -> None:
    """Step to the end, checking every block's refcount against the live tables."""
    while ex.step():
        s = ex.scheduler
        s.kv.check_invariants()
        s.kv.check_refcounts([*s.running, *s.waiting()])


# ---- the params' rules -----------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n=0), "n=0"),
        (dict(n=3, best_of=2), "best_of=2: must be >= n (3)"),
        (dict(n=True), "n=True"),
        (dict(beam_width=2), "beam_width=2: needs use_beam_search=True"),
        (dict(beam_width=0), "beam_width=0: must be an integer in [1, 256]"),
        (dict(use_beam_search=True, beam_width=0), "beam_width=0: must be an integer in [1"),
        (dict(use_beam_search=True, beam_width=2, n=3), "n=3: must be at most the beam width"),
        (dict(use_beam_search=True, temperature=0.7), "temperature=0.7: beam search is greedy"),
        (dict(use_beam_search=True, logprobs=1), "logprobs=1"),
        (dict(use_beam_search=True, stop="x"), "stop"),
        (dict(use_beam_search=True, beam_width=2, best_of=3), "best_of=3: differs"),
        (dict(early_stopping="sometimes"), "early_stopping='sometimes'"),
        (dict(length_penalty=float("nan")), "length_penalty=nan"),
        (dict(n=10_000), "n=10000"),
    ],
)
def test_bad_output_params_are_refused_naming_the_field(fields, message):
    with pytest.raises(RequestError, match="sampling parameter") as e:
        SamplingParams(**fields)
    assert message in str(e.value)


def test_output_counts_and_plain_rule():
    assert SamplingParams(n=3).num_branches == 3
    assert SamplingParams(n=2, best_of=5).num_branches == 5
    assert SamplingParams(use_beam_search=True, beam_width=4).num_branches == 4
    assert SamplingParams(use_beam_search=True, n=3).num_branches == 3  # width defaults to n
    assert SamplingParams(n=4, temperature=1.0).is_plain  # samples decode as plain rows
    assert not SamplingParams(n=2, best_of=3, temperature=1.0).is_plain  # ranked by logprob
    assert not SamplingParams(use_beam_search=True, beam_width=2).is_plain
    with pytest.raises(RequestError, match="streaming with best_of=3 > n=1"):
        Request(prompt_token_ids=[1, 2], sampling=SamplingParams(best_of=3), streaming=True)


# ---- the KV manager's fork -------------------------------------------------------------
def _admitted(kv: KVCacheManager, rid: int, n_tokens: int, branch: int = 0) -> Sequence:
    seq = Sequence(rid, list(range(3, 3 + n_tokens)), SamplingParams(), 8, 0.0, branch=branch)
    kv.allocate_prefix(seq)
    assert kv.append_slots(seq, n_tokens)
    seq.num_computed_tokens = n_tokens
    return seq


def test_share_counts_references_and_copies_the_last_block_once_on_write():
    kv = KVCacheManager(16, 4, enable_block_reuse=False)
    parent = _admitted(kv, 0, 10)  # blocks 0, 1 full, block 2 holds 2 of 4 tokens
    kids = [Sequence(0, parent.prompt_token_ids, parent.sampling, 8, 0.0, branch=b)
            for b in (1, 2)]  # fmt: skip
    kv.share([parent, parent], kids)
    assert [k.block_table for k in kids] == [[0, 1, 2], [0, 1, 2]]
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [3, 3, 3]
    assert all(s.shares_last_block for s in (parent, *kids))
    kv.check_refcounts([parent, *kids])
    assert kv.num_blocks_needed(kids[0], 1) == 1  # the copy
    assert kv.append_slots(kids[0], 1)
    assert kids[0].block_table[:2] == [0, 1] and kids[0].block_table[2] not in (0, 1, 2)
    assert kv.take_copies() == ((2, kids[0].block_table[2]),)
    assert kv.append_slots(kids[1], 1) and kv.append_slots(parent, 1)
    assert len(kv.take_copies()) == 1  # the last writer owns the original alone: no copy
    assert kv.take_copies() == ()
    kv.check_refcounts([parent, *kids])
    assert not any(s.shares_last_block for s in (parent, *kids))
    for s in (parent, *kids):
        kv.free(s)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.total_blocks


def test_a_beam_reorder_releases_the_unchosen_tables():
    kv = KVCacheManager(16, 4, enable_block_reuse=False)
    a, b = _admitted(kv, 0, 6), _admitted(kv, 0, 6, branch=1)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    kv.share([a, a], [a, b])  # both beams continue beam a
    assert a.block_table == b.block_table == a_blocks
    assert all(kv.ref_count(x) == 0 for x in b_blocks)
    assert kv.num_free_blocks == 16 - len(a_blocks)
    kv.check_refcounts([a, b])


# ---- samples ---------------------------------------------------------------------------
def test_samples_prefill_once_fork_at_the_first_token_and_share_the_prompt():
    ex = Executor(fake_parts())
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + a partial one
    rid = ex.enqueue_request(Request(prompt_token_ids=prompt, sampling=sampled(3)))
    ex.step()  # the prefill: one sequence, one row
    s = ex.scheduler
    assert ex.step_records[0].num_prefill_tokens == len(prompt)
    seqs = list(s.running)
    assert [q.branch for q in seqs] == [0, 1, 2]
    assert [len(q.output_token_ids) for q in seqs] == [1, 1, 1]
    assert {tuple(q.block_table) for q in seqs} == {tuple(seqs[0].block_table)}
    assert s.kv.ref_count(seqs[0].block_table[0]) == 3
    checked_run(ex)
    assert ex.runner.copies and len(ex.runner.copies) == 2  # two samples copied block 2
    [final] = [r for r in ex.await_responses(rid) if r.is_final]
    outs = final.completions
    assert [c.index for c in outs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in outs)
    assert len({tuple(c.token_ids) for c in outs}) == 3  # three seed streams
    assert final.token_ids == outs[0].token_ids
    assert sum(r.num_prompt_tokens for r in [ex.request_record(rid)]) == len(prompt)
    assert_pool_free(ex)


def test_a_prompt_of_whole_blocks_forks_without_a_copy():
    ex = Executor(fake_parts())
    ex.enqueue_request(Request(prompt_token_ids=list(range(3, 3 + 2 * TOKENS_PER_BLOCK)),
                               sampling=sampled(4)))  # fmt: skip
    checked_run(ex)
    assert getattr(ex.runner, "copies", []) == []
    assert_pool_free(ex)


def test_seeded_samples_are_the_same_alone_and_in_a_batch():
    def run(batch: bool) -> list[list[int]]:
        ex = Executor(fake_parts(max_batch_size=16))
        others = [Request(prompt_token_ids=[7, 8, 9], sampling=sampled(2, seed=s)) for s in (1, 2)]
        if batch:
            ex.enqueue_request(others[0])
        rid = ex.enqueue_request(Request(prompt_token_ids=[4, 5, 6, 7, 8], sampling=sampled(4)))
        if batch:
            ex.enqueue_request(others[1])
        checked_run(ex)
        [final] = [r for r in ex.await_responses(rid) if r.is_final]
        assert_pool_free(ex)
        return [c.token_ids for c in final.completions]

    assert run(False) == run(True)


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob():
    ex = Executor(fake_parts())
    all4 = ex.generate([[4, 5, 6]], sampled(4, logprobs=0))[0].completions
    best = ex.generate([[4, 5, 6]], sampled(2, best_of=4))[0].completions
    ranked = sorted(all4, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    assert best[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)
    assert best[0].logprobs is None  # computed to rank, not asked for
    assert_pool_free(ex)


def test_streamed_samples_carry_their_index_and_add_up():
    ex = Executor(fake_parts())
    rid = ex.enqueue_request(
        Request(prompt_token_ids=[4, 5, 6], sampling=sampled(3), streaming=True)
    )
    got = []
    while not any(r.is_final for r in got):
        got += ex.await_responses(rid)
    final = got[-1]
    assert [r.is_final for r in got].count(True) == 1
    for c in final.completions:
        ids = [t for r in got if r.index == c.index for t in r.new_token_ids]
        assert ids == c.token_ids


def test_one_sample_stops_on_its_own_eos():
    # EOS 2 ends a sample whose token is 2; the others go on to their length
    runner = FakeRunner()
    ex = Executor(fake_parts(eos=(2,)))
    ex.runner = runner
    sp = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, n=4)
    out = ex.generate([[9, 10, 11]], sp)[0]
    reasons = {c.finish_reason for c in out.completions}
    assert reasons <= {FinishReason.STOP, FinishReason.LENGTH}
    for c in out.completions:
        assert (c.finish_reason is FinishReason.STOP) == (c.token_ids[-1] == 2)
    assert_pool_free(ex)


@pytest.mark.parametrize("when", [0, 1, 3])
def test_cancelling_samples_frees_every_block(when):
    ex = Executor(fake_parts())
    rid = ex.enqueue_request(Request(prompt_token_ids=list(range(3, 13)), sampling=sampled(4)))
    for _ in range(when):
        ex.step()
    assert ex.cancel_request(rid)
    checked_run(ex)
    [final] = ex.await_responses(rid)
    assert final.is_final and final.finish_reason is FinishReason.CANCELLED
    assert_pool_free(ex)


def test_a_failing_sample_fails_its_request_and_frees_every_block():
    class Faulty(FakeRunner):
        def step(self, batch):
            if self.steps == 2:
                self.steps += 1
                raise RequestFault(0, "injected fault")
            return super().step(batch)

    parts = fake_parts()
    parts.runner = Faulty()
    ex = Executor(parts)
    rid = ex.enqueue_request(Request(prompt_token_ids=list(range(3, 13)), sampling=sampled(3)))
    other = ex.enqueue_request(Request(prompt_token_ids=[5, 6], sampling=sampled(1)))
    checked_run(ex)
    [final] = [r for r in ex.await_responses(rid) if r.is_final]
    assert final.finish_reason is FinishReason.ERROR and "injected fault" in final.error
    assert [r for r in ex.await_responses(other) if r.is_final][0].error is None
    assert_pool_free(ex)


def test_preempted_samples_are_reprefilled_and_complete():
    parts = fake_parts(num_blocks=16, policy="max_utilization", max_batch_size=12)
    ex = Executor(parts)
    ids = [ex.enqueue_request(Request(prompt_token_ids=list(range(3 + i, 12 + i)),
                                      sampling=sampled(3, max_new_tokens=12, seed=i)))
           for i in range(3)]  # fmt: skip
    checked_run(ex)
    assert ex.scheduler.stats().num_preemptions > 0
    finals = {r.request_id: r for r in ex.await_responses() if r.is_final}
    assert all(len(c.token_ids) == 12 for i in ids for c in finals[i].completions)
    # the same outputs as without preemption (a sample's tokens depend on its stream only)
    calm = Executor(fake_parts(num_blocks=64, max_batch_size=12))
    for i in range(3):
        calm.enqueue_request(Request(prompt_token_ids=list(range(3 + i, 12 + i)),
                                     sampling=sampled(3, max_new_tokens=12, seed=i)))  # fmt: skip
    calm.run_until_complete()
    ref = {r.request_id: r for r in calm.await_responses() if r.is_final}
    for i in ids:
        assert [c.token_ids for c in finals[i].completions] == [
            c.token_ids for c in ref[i].completions
        ]
    assert_pool_free(ex)


# ---- admission ---------------------------------------------------------------------------
def test_more_sequences_than_the_batch_holds_are_refused():
    ex = Executor(fake_parts(max_batch_size=4))
    [out] = ex.generate([[3, 4]], sampled(5))
    assert out.error and "n=5 sequences are more than the run's max_batch_size=4" in out.error


def test_more_beams_than_the_engine_was_built_for_are_refused_naming_both():
    s = make_scheduler(32, max_batch_size=8, max_num_tokens=16, max_seq_len=32,
                       tokens_per_block=4, max_beam_width=2)  # fmt: skip
    seq = Sequence(0, [3, 4, 5], beams(4), 4, 0.0)
    with pytest.raises(RequestError, match="beam_width=4 .* max_beam_width=2"):
        s.add(seq)


def test_a_request_whose_samples_cannot_all_fit_the_pool_is_refused():
    s = make_scheduler(6, max_batch_size=8, max_num_tokens=16, max_seq_len=32,
                       tokens_per_block=4)  # fmt: skip
    seq = Sequence(0, list(range(3, 11)), sampled(4, max_new_tokens=8), 8, 0.0)
    with pytest.raises(RequestError, match="for each of 4 sequences"):
        s.add(seq)


def test_guaranteed_no_evict_admits_only_room_for_every_sample():
    # 4 samples x 4 blocks of life = 16 blocks: the second request waits for the first
    ex = Executor(fake_parts(num_blocks=20, max_batch_size=16))
    for _ in range(2):
        ex.enqueue_request(Request(prompt_token_ids=list(range(3, 11)),
                                   sampling=sampled(4, max_new_tokens=8)))  # fmt: skip
    ex.step()
    assert ex.scheduler.num_waiting == 1
    checked_run(ex)
    assert_pool_free(ex)


# ---- beams (fake logits) -------------------------------------------------------------
def _beam_run(**parts_kw) -> tuple[Executor, dict[int, list]]:
    ex = Executor(fake_parts(max_batch_size=12, max_beam_width=4, **parts_kw))
    prompts = [list(range(3 + i, 14 + i)) for i in range(3)]
    for p in prompts:
        ex.enqueue_request(Request(prompt_token_ids=p, sampling=beams(3, max_new_tokens=10)))
    ex.enqueue_request(Request(prompt_token_ids=[5, 6, 7], sampling=sampled(1, max_new_tokens=10)))
    checked_run(ex)
    finals = {r.request_id: r for r in ex.await_responses() if r.is_final}
    assert_pool_free(ex)
    return ex, {i: [(c.token_ids, c.cumulative_logprob) for c in f.completions or []]
                for i, f in finals.items()}  # fmt: skip


def test_beams_run_in_lockstep_and_survive_preemption():
    _, calm = _beam_run(num_blocks=64)
    assert all(len(calm[i]) == 3 for i in range(3))
    ex, tight = _beam_run(num_blocks=20, policy="max_utilization")
    assert ex.scheduler.stats().num_preemptions > 0
    assert tight == calm
    for rec in ex.step_records:  # a group's beams are always scheduled together
        assert rec.num_tokens <= 32


def test_beam_search_cancelled_midway_frees_every_block():
    ex = Executor(fake_parts(max_batch_size=12, max_beam_width=4))
    rid = ex.enqueue_request(Request(prompt_token_ids=list(range(3, 14)), sampling=beams(4)))
    ex.step()
    ex.step()
    assert ex.cancel_request(rid)
    checked_run(ex)
    [final] = ex.await_responses(rid)
    assert final.finish_reason is FinishReason.CANCELLED and len(final.completions) == 4
    assert_pool_free(ex)


@pytest.mark.parametrize("params", [sampled(3, max_new_tokens=1), beams(3, max_new_tokens=1)])
def test_one_new_token_forks_and_finishes_in_the_same_step(params):
    ex = Executor(fake_parts(max_beam_width=4))
    [out] = ex.generate([[4, 5, 6, 7, 8]], params)
    assert out.ok and len(out.completions) == 3
    assert all(len(c.token_ids) == 1 for c in out.completions)
    assert {c.finish_reason for c in out.completions} == {FinishReason.LENGTH}
    assert len(ex.step_records) == 1
    assert_pool_free(ex)
