"""``llmc bench``'s closed loop queues an offline run's requests in bursts of
``INTAKE_BURST`` with one engine step after each (``benchmark._run_closed``), so the
device computes while the rest are queued; ``await_responses(max_steps=...)`` bounds the
steps a caller-thread call runs. CPU, torch backend, a tiny Llama."""

from __future__ import annotations

import contextlib

import pytest

from helpers.runner import tiny_runtime
from llmc.runtime.bench import benchmark
from llmc.runtime.bench.workload import WorkloadRequest
from llmc.runtime.executor import Executor
from llmc.runtime.types import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_weights, tiny_tok):
    return (*tiny_llama_weights, tiny_tok)


class _Served:
    """The part of ``llmc.LLM`` that ``_run_closed`` drives, over an Executor."""

    def __init__(self, ex: Executor) -> None:
        self.ex = ex
        self.enqueue_request = ex.enqueue_request
        self.await_responses = ex.await_responses

    def in_caller_thread(self):
        return contextlib.nullcontext()


def _requests(n: int) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"t{i}", 2 + i % 3, tuple(5 + (i * 7 + j) % 80 for j in range(3)))
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("burst", [4, 1000])
def test_an_offline_run_queues_in_bursts_and_serves_every_request(tiny, monkeypatch, burst):
    monkeypatch.setattr(benchmark, "INTAKE_BURST", burst)
    reqs = _requests(30)
    ex = Executor(tiny_runtime(tiny))
    benchmark._run_closed(_Served(ex), reqs, len(reqs), None, benchmark.BenchSampling())
    recs = ex.request_records
    assert sorted(len(r.token_times) for r in recs) == sorted(w.output_tokens for w in reqs)
    last_arrival = max(r.arrival_time for r in recs)
    first_step = min(r.scheduled_time for r in recs)
    if burst < len(reqs):  # the engine ran while the later bursts were queued
        assert first_step < last_arrival
        assert sum(r.arrival_time > first_step for r in recs) >= len(reqs) - burst
    else:  # everything queued before the first step (the old intake)
        assert first_step > last_arrival


def test_a_concurrency_limit_below_the_burst_keeps_the_loop_as_it_was(tiny, monkeypatch):
    """A closed loop of ``limit`` clients refills up to ``limit`` before every step."""
    seen: list[int] = []
    reqs = _requests(12)
    ex = Executor(tiny_runtime(tiny))
    served = _Served(ex)
    step = ex.step

    def counted():
        seen.append(ex.scheduler.num_waiting + ex.scheduler.num_running)
        return step()

    monkeypatch.setattr(ex, "step", counted)
    benchmark._run_closed(served, reqs, 3, None, benchmark.BenchSampling())
    assert len(ex.request_records) == 12
    assert max(seen) == 3 and seen[0] == 3


def test_await_responses_runs_at_most_max_steps(tiny):
    ex = Executor(tiny_runtime(tiny))
    rid = ex.enqueue_request(
        Request(
            prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=6, ignore_eos=True)
        )
    )
    assert ex.await_responses(rid, max_steps=0) == [] and not ex.step_records
    assert ex.await_responses(rid, max_steps=1) == [] and len(ex.step_records) == 1
    assert ex.await_responses(rid, max_steps=2) == [] and len(ex.step_records) == 3
    (final,) = ex.await_responses(rid)
    assert final.is_final and len(final.token_ids) == 6
