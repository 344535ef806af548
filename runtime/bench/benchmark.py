"""Drive a served engine with a workload and collect its records into a versioned BenchResult.

``run_workload`` sends the requests to a ``Served`` engine (``llmc.LLM``) in the arrival mode
asked for and returns the engine's own RequestRecords and StepRecords of the measured part
(warm-up requests run first, to completion, and are excluded). Modes:

- offline: every request is enqueued at once; the engine loop runs in this thread
  (``in_caller_thread``).
- concurrency N: closed loop in this thread: N requests in flight, a finished one is
  replaced before the next step.
- request_rate R: the engine loop runs in its background thread while this thread enqueues
  each request at its scheduled arrival time (so arrival times are real).

Every request samples as ``BenchSampling`` says (greedy by default) with ``ignore_eos`` and
``max_new_tokens`` = its output length, so output lengths are exact. The JSON schema
(``SCHEMA``, ``SCHEMA_VERSION``) holds config, environment, ceilings, aggregates, achieved
rates, per-request records and an optional peer run; bump the version when a field changes
meaning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llmc.runtime.bench.metrics import Aggregates, aggregate, e2e, tpot, ttft
from llmc.runtime.bench.served import Served
from llmc.runtime.bench.workload import ArrivalSpec, BenchSampling, WorkloadRequest, arrival_offsets
from llmc.runtime.gc_heap import frozen_heap
from llmc.runtime.records import RequestRecord, StepRecord
from llmc.runtime.types import Request

SCHEMA = "llmc.bench"
SCHEMA_VERSION = 1

ProgressFn = Callable[[int, int], None]
"""Called with (requests finished, requests measured)."""


@dataclass
class WorkloadRun:
    """The measured part of one run: the engine's records and the window."""

    requests: list[RequestRecord]
    steps: list[StepRecord]
    task_ids: dict[int, str]
    start: float
    end: float


INTAKE_BURST = 128
"""Requests ``_run_closed`` queues between two engine steps while it has more to send."""


def to_request(w: WorkloadRequest, how: BenchSampling = BenchSampling()) -> Request:
    sampling = how.params(w.output_tokens)
    if w.prompt_token_ids is not None:
        return Request(prompt_token_ids=list(w.prompt_token_ids), sampling=sampling)
    return Request(prompt=w.prompt, sampling=sampling)


class _InFlight:
    """The requests a run has sent and not yet seen finish, with each one's task id."""

    def __init__(
        self, engine: Served, total: int, progress: ProgressFn | None, how: BenchSampling
    ) -> None:
        self.engine, self.total, self.progress, self.how = engine, total, progress, how
        self.ids: set[int] = set()
        self.task_ids: dict[int, str] = {}
        self.finished = 0

    def send(self, w: WorkloadRequest) -> None:
        rid = self.engine.enqueue_request(to_request(w, self.how))
        self.task_ids[rid] = w.task_id
        self.ids.add(rid)

    def collect(self, timeout: float | None = None, max_steps: int | None = None) -> None:
        """Take the responses ready (waiting up to ``timeout``; in caller-thread mode this
        runs engine steps, at most ``max_steps``) and retire the requests whose final
        response came."""
        for r in self.engine.await_responses(list(self.ids), timeout, max_steps):
            if r.is_final:
                self.ids.discard(r.request_id)
                self.finished += 1

    def report(self) -> None:
        if self.progress is not None:
            self.progress(self.finished, self.total)


def _run_closed(
    engine: Served,
    reqs: Sequence[WorkloadRequest],
    limit: int,
    progress: ProgressFn | None,
    how: BenchSampling,
) -> dict[int, str]:
    """Keep ``limit`` requests in flight until all are done (offline: limit = all), the
    engine stepped by this thread. The requests go in ``INTAKE_BURST`` at a time with one
    engine step after each burst, so the step in flight runs on the device while the next
    burst is made and queued (an offline run's intake is not a stretch of idle device
    before its first step); each burst is more than a step admits."""
    flight = _InFlight(engine, len(reqs), progress, how)
    pending = list(reversed(reqs))
    with engine.in_caller_thread():
        while pending or flight.ids:
            room = min(len(pending), limit - len(flight.ids))
            for _ in range(min(room, INTAKE_BURST)):
                flight.send(pending.pop())
            flight.collect(max_steps=1 if room > INTAKE_BURST else None)
            flight.report()
    return flight.task_ids


def _run_open(
    engine: Served,
    reqs: Sequence[WorkloadRequest],
    offsets: list[float],
    progress: ProgressFn | None,
    how: BenchSampling,
) -> dict[int, str]:
    """Enqueue each request at its arrival time while the background loop runs."""
    flight = _InFlight(engine, len(reqs), progress, how)
    t0 = time.perf_counter()
    for w, off in zip(reqs, offsets, strict=True):
        while (wait := t0 + off - time.perf_counter()) > 0:
            if flight.ids:
                flight.collect(timeout=wait)
            else:
                time.sleep(wait)
        flight.send(w)
    while flight.ids:
        flight.collect(timeout=1.0)
        flight.report()
    return flight.task_ids


def run_workload(
    engine: Served,
    requests: Sequence[WorkloadRequest],
    arrival: ArrivalSpec,
    *,
    warmup: Sequence[WorkloadRequest] = (),
    progress: ProgressFn | None = None,
    measure: AbstractContextManager[Any] | None = None,
    sampling: BenchSampling = BenchSampling(),
) -> WorkloadRun:
    """Run warm-up requests (excluded), then the measured requests in ``arrival`` mode, each
    sampling as ``sampling`` says. ``measure`` (a profiling session) is entered around the
    measured part only; the process's heap is frozen around it (``llmc.runtime.gc_heap``:
    no full garbage collection walks the engine's heap mid-run)."""
    if warmup:
        _run_closed(engine, warmup, len(warmup), None, sampling)
    with frozen_heap(), measure if measure is not None else contextlib.nullcontext():
        first_step = len(engine.step_records)
        first_req = {r.request_id for r in engine.request_records}
        start = time.perf_counter()
        if arrival.mode == "request_rate":
            offsets = arrival_offsets(len(requests), arrival)
            assert offsets is not None
            task_ids = _run_open(engine, requests, offsets, progress, sampling)
        else:
            limit = arrival.concurrency if arrival.mode == "concurrency" else len(requests)
            task_ids = _run_closed(engine, requests, max(1, int(limit or 1)), progress, sampling)
        end = time.perf_counter()
    recs = [r for r in engine.request_records if r.request_id not in first_req]
    return WorkloadRun(recs, list(engine.step_records[first_step:]), task_ids, start, end)


# ---- result -----------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    """stdout of ``git ARGS`` run in the llmc checkout; None when it fails or is not git."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """Commit of the llmc checkout (with '-dirty' when it has changes), None outside git.
    ``LLMC_COMMIT``, when set, names it instead: a copied working tree whose .git is not its
    own (the lent GPU machine's copy keeps a stale .git) would report the wrong commit."""
    if named := os.environ.get("LLMC_COMMIT"):
        return named
    sha = _git("rev-parse", "--short=12", "HEAD")
    if sha is None:
        return None
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return sha + ("-dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: Any) -> dict[str, Any]:
    """Device, versions and commit of this run."""
    import importlib.metadata as md

    import torch

    from llmc.base.version import __version__ as llmc_version

    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"{_cpu_name()} ({os.cpu_count()} cores)"

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {
        "device": str(dev),
        "device_name": name,
        "llmc_version": llmc_version,
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "transformers_version": version("transformers"),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }


def request_rows(run: WorkloadRun) -> list[dict[str, Any]]:
    """Per-request records as JSON rows, times in seconds after the run's start."""

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - run.start, 6)

    rows = []
    for r in sorted(run.requests, key=lambda r: r.request_id):
        rows.append(
            {
                "request_id": r.request_id,
                "task_id": run.task_ids.get(r.request_id),
                "num_prompt_tokens": r.num_prompt_tokens,
                "num_output_tokens": r.num_output_tokens,
                "num_cached_tokens": r.num_cached_tokens,
                "num_preemptions": r.num_preemptions,
                "arrival_time": rel(r.arrival_time),
                "scheduled_time": rel(r.scheduled_time),
                "first_token_time": rel(r.first_token_time),
                "finish_time": rel(r.finish_time),
                "ttft": ttft(r),
                "tpot": tpot(r),
                "e2e": e2e(r),
                "token_times": [rel(t) for t in r.token_times],
                "finish_reason": r.finish_reason,
                "error": r.error,
            }
        )
    return rows


@dataclass
class BenchResult:
    """One benchmark: what ran, where, and what it measured (``to_dict`` is the JSON)."""

    config: dict[str, Any]
    environment: dict[str, Any]
    aggregates: Aggregates
    requests: list[dict[str, Any]]
    ceilings: dict[str, Any] | None = None
    achieved: dict[str, Any] | None = None
    peer: dict[str, Any] | None = None
    """The peer's run: {name, config, aggregates, achieved, requests}."""
    extra: dict[str, Any] = field(default_factory=dict)
    created_at: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )

    def ratios(self) -> dict[str, float | None]:
        """llmc ÷ peer for each headline number (None where either is missing)."""
        from llmc.runtime.bench.report import dig, headlines, ratio

        if self.peer is None:
            return {}
        mine = {"aggregates": self.aggregates.to_dict()}
        return {
            h.label: ratio(dig(mine, h.path), dig(self.peer, h.path))
            for h in headlines(list(self.aggregates.percentiles))
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "created_at": self.created_at,
            "config": self.config,
            "environment": self.environment,
            "ceilings": self.ceilings,
            "aggregates": self.aggregates.to_dict(),
            "achieved": self.achieved,
            "peer": self.peer,
            "ratios": self.ratios(),
            "requests": self.requests,
            **self.extra,
        }


def aggregate_run(
    run: WorkloadRun, percentiles: Sequence[float], tokens_per_block: int | None
) -> Aggregates:
    return aggregate(
        run.requests,
        run.steps,
        percentiles=percentiles,
        tokens_per_block=tokens_per_block,
        window=(run.start, run.end),
    )
