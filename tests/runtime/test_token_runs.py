"""Deferred rows' token times kept in runs (runtime/token_runs.py) against the per-row pass.

Two Executors over the same randomized workload (arrivals mid-run, streaming and
non-streaming requests, stop ids, EOS, min_tokens, logprobs, n = 2 forks, cancellations,
preemption on a small pool), stepped in lockstep on one fake clock: one with ``TokenRuns``
(the vectorised paths on every batch), one without (``_runs = None``: every row through the
per-row loop). After every step both show the same responses, request records (read
mid-run too, which settles the runs), step records and KV blocks; at the end every block
and slot is free.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from helpers.fakes import FakeRunner, FakeStepOutput, fake_parts
from llmc.runtime import executor
from llmc.runtime.executor import Executor
from llmc.runtime.request_state import RequestState
from llmc.runtime.scheduler import Scheduler
from llmc.runtime.token_runs import TokenRuns
from llmc.runtime.types import Request, SamplingParams


class _Pending:
    """A launched fake step whose tokens are made when read (the step before it has been
    applied by then, as on the device)."""

    def __init__(self, runner: FakeRunner, batch) -> None:
        self.runner, self.batch = runner, batch

    def ready(self) -> bool:
        return True

    def result(self):
        if self.batch.branching:
            return FakeRunner.step(self.runner, self.batch)
        # (a row may have finished since its launch: its blocks are gone, its token unused)
        toks = [self.runner.next_token(ss.seq) for ss in self.batch.sequences if ss.sample]
        return FakeStepOutput(toks)


class _AsyncRunner(FakeRunner):
    """FakeRunner with ``launch`` (async scheduling), blocks unchecked at launch."""

    def launch(self, batch, src_rows=None):
        return _Pending(self, batch)


def _workload(seed: int) -> tuple[list[tuple[int, Request]], dict[int, int]]:
    """(arrival step, request) pairs and {request index: step it is cancelled at}."""
    rng = random.Random(seed)
    reqs, cancels = [], {}
    for i in range(40):
        kind = rng.random()
        kw = {}
        if kind < 0.1:
            kw["stop_token_ids"] = (rng.randrange(3, 256),)
        elif kind < 0.15:
            kw["logprobs"] = 1
        elif kind < 0.2:
            kw["n"] = 2
        elif kind < 0.25:
            kw["min_tokens"] = 1
        sp = SamplingParams(
            max_new_tokens=rng.randrange(1, 40), ignore_eos=rng.random() < 0.7, **kw
        )
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))]
        arrival = 0 if i < 12 else rng.randrange(0, 60)
        reqs.append((arrival, Request(prompt_token_ids=prompt, sampling=sp,
                                      streaming=rng.random() < 0.25)))  # fmt: skip
        if rng.random() < 0.1:
            cancels[i] = arrival + rng.randrange(1, 25)
    return reqs, cancels


def _executor(async_scheduling: bool, runs: bool, num_blocks: int) -> Executor:
    parts = fake_parts(num_blocks=num_blocks, max_batch_size=12, max_num_tokens=40,
                       policy="max_utilization")  # fmt: skip
    if async_scheduling:
        parts = parts.__class__(_AsyncRunner(), parts.scheduler, parts.vocab_size, None)
    ex = Executor(parts, async_scheduling=async_scheduling)
    if not runs:
        ex._runs = None
    return ex


def _seen(ex: Executor, got: dict[int, list]) -> tuple:
    records = [(r.request_id, r.first_token_time, tuple(r.token_times), r.finish_time,
                r.num_output_tokens, r.finish_reason) for r in ex.request_records]  # fmt: skip
    kv = ex.scheduler.kv
    steps = [dataclasses.replace(r, phase_times={}) for r in ex.step_records]  # (runner's clock)
    return records, steps, kv.num_free_blocks, {k: list(v) for k, v in got.items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_runs_equal_the_per_row_pass(monkeypatch, async_scheduling, seed):
    monkeypatch.setattr(Scheduler, "vector_rows", 1)
    clock = [0.0]
    monkeypatch.setattr(executor, "_now", lambda: clock[0])
    reqs, cancels = _workload(seed)
    in_runs = [0]  # rows whose token went into a run
    run_step = TokenRuns.step

    def counted(self, rows, states, now, k=1):
        rest = run_step(self, rows, states, now, k)
        in_runs[0] += len(rows.slots) - len(rest)
        return rest

    monkeypatch.setattr(TokenRuns, "step", counted)
    num_blocks = 24 if seed % 3 == 0 else 96  # a small pool: preemptions
    exs = [_executor(async_scheduling, runs, num_blocks) for runs in (True, False)]
    got: list[dict[int, list]] = [{}, {}]
    ids: list[dict[int, int]] = [{}, {}]
    step = 0
    while True:
        busy = False
        clock[0] += 1.0
        for e, ex in enumerate(exs):
            for i, (arrival, req) in enumerate(reqs):
                if arrival == step:
                    ids[e][i] = ex.enqueue_request(req)
            for i, at in cancels.items():
                if at == step and i in ids[e]:
                    ex.cancel_request(ids[e][i])
            busy |= ex.step()
            for r in ex.await_responses(timeout=0):
                got[e].setdefault(r.request_id, []).append(r)
        if step % 5 == 0 or not busy:
            assert _seen(exs[0], got[0]) == _seen(exs[1], got[1]), f"step {step}"
        step += 1
        if not busy and step > 60:
            break
    assert len(got[0]) == len(reqs)
    for ex in exs:
        assert ex.scheduler.kv.num_free_blocks == ex.scheduler.kv.total_blocks
        assert ex.scheduler.slots.num_used == 0
        for rs in got[0].values():
            assert sum(r.is_final for r in rs) == 1
    assert in_runs[0] > 20
    if num_blocks == 24:
        assert exs[0].scheduler.stats().num_preemptions > 0
    runs = exs[0]._runs
    assert len(runs.times) > 0 and all(o is None for o in runs.owner)


def test_a_run_is_settled_when_its_slot_changes_hands(monkeypatch):
    """A row that misses a step, or whose slot another sequence took, starts a new run; the
    old one is written first (unit level, over a real SlotState)."""
    from llmc.runtime.records import RequestRecord
    from llmc.runtime.slot_state import DecodeRows, SlotState
    from llmc.runtime.types import Sequence

    st = SlotState(4, 8)
    runs = TokenRuns()
    sp = SamplingParams(max_new_tokens=50, ignore_eos=True)
    seqs, states = [], {}
    for i in range(2):
        seq = Sequence(i, [5, 6], sp, 50, 0.0)
        seq.output_token_ids.append(7)
        st.assign(seq, frozenset())
        rec = RequestRecord(i, 0.0, 2, first_token_time=0.5, token_times=[0.5])
        states[i] = RequestState(Request(prompt_token_ids=[5, 6], sampling=sp), rec, seq,
                                 num_seen=1, deferred=True)  # fmt: skip
        seqs.append(seq)

    def step(active, now):
        start = st._np.array([q.num_computed_tokens for q in active])
        rows = DecodeRows(active, st._np.array([q.slot for q in active]), start, st)
        for q in active:  # the step's update
            q.output_token_ids.append(9)
            q.num_computed_tokens += 1
            st.advance(q)
        return runs.step(rows, states, now)

    assert step(seqs, 1.0) == [] and step(seqs, 2.0) == []
    assert step(seqs[:1], 3.0) == []  # request 1 misses this step
    assert step(seqs, 4.0) == []  # its run restarts (the old one settled)
    assert states[1].record.token_times == [0.5, 1.0, 2.0] and states[1].num_seen == 3
    st.release(seqs[0])  # preempted: its slot goes to another sequence
    st.assign(seqs[0], frozenset())
    assert step(seqs, 5.0) == []
    assert states[0].record.token_times == [0.5, 1.0, 2.0, 3.0, 4.0]
    runs.settle_all()
    for s in states.values():
        assert s.run is None and s.num_seen == len(s.seq.output_token_ids)
    assert states[0].record.token_times == [0.5, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert states[1].record.token_times == [0.5, 1.0, 2.0, 4.0, 5.0]


@pytest.fixture(scope="module")
def tiny(tiny_llama_weights, tiny_tok):
    return (*tiny_llama_weights, tiny_tok)


@pytest.mark.usefixtures("one_torch_thread")
def test_windows_in_runs_equal_the_per_row_pass(tiny, monkeypatch):
    """Multi-step windows (K = 4, tiny Llama on CPU) with stop ids, stop strings, streaming
    and staggered arrivals: runs (``k`` tokens a window) give what the per-row pass gives."""
    from helpers.runner import tiny_runtime

    monkeypatch.setattr(Scheduler, "vector_rows", 1)
    clock = [0.0]
    monkeypatch.setattr(executor, "_now", lambda: clock[0])
    in_windows = [0]  # rows whose window tokens went into a run
    run_step = TokenRuns.step

    def counted(self, rows, states, now, k=1):
        rest = run_step(self, rows, states, now, k)
        in_windows[0] += (len(rows.slots) - len(rest)) * (k > 1)
        return rest

    monkeypatch.setattr(TokenRuns, "step", counted)
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 25, 9, 14, 11, 8)]
    sps[1] = SamplingParams(max_new_tokens=25, stop_token_ids=(40, 41, 42))
    sps[3] = SamplingParams(max_new_tokens=14, ignore_eos=True, stop=("e",))
    prompts = [
        [5 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((3, 11, 25, 7, 1, 17))
    ]
    exs = []
    for runs in (True, False):
        ex = Executor(tiny_runtime(tiny, decode_steps_per_iteration=4))
        if not runs:
            ex._runs = None
        exs.append(ex)
    got: list[list] = [[], []]
    for n in range(200):
        clock[0] += 1.0
        busy = False
        for e, ex in enumerate(exs):
            if n % 3 == 0 and n // 3 < len(prompts):
                i = n // 3
                ex.enqueue_request(Request(prompt_token_ids=prompts[i], sampling=sps[i],
                                           streaming=i == 4))  # fmt: skip
            busy |= ex.step()
            got[e] += ex.await_responses(timeout=0)
        assert _seen(exs[0], {0: got[0]}) == _seen(exs[1], {0: got[1]}), f"step {n}"
        if not busy and n > 20:
            break
    assert any(r.num_steps > 1 for r in exs[0].step_records), "no window ran"
    assert in_windows[0] > 5
    assert sum(r.is_final for r in got[0]) == len(prompts)
