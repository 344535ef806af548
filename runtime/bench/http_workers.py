"""``llmc bench --url`` with several client processes: one workload, one window, N senders.

One Python process streams a few thousand SSE chunks a second before its event loop falls
behind: ``scripts/serve_client_overhead.py`` measured ~44 µs of client CPU a chunk on the CI
box, so 256 streams of a ~15 ms decode step keep one core ~75 % busy and the chunk lag at
~36 ms (p50); on the H200's host the client's own lag reached 56 ms of every first token
and the served run kept fewer requests in the engine than in-process. ``run_sharded``
spreads the streams over ``workers`` processes (spawned: no inherited threads or CUDA),
as load generators such as GuideLLM do:

- concurrency N (and offline, whose limit is every request): worker w keeps
  N // W (+1 for the first N % W workers) requests in flight and takes the next request
  index from one shared counter, so the whole run has N in flight until the requests run
  out, in the single process's order;
- request_rate: the single process's arrival offsets, request i sent by worker i % W at its
  offset after the common start.

Every worker opens its client, waits at a barrier, then starts at one start time the parent
sets; ``perf_counter`` is the system-wide monotonic clock on Linux (and macOS), so the
records' times of all workers are on one clock. The parent collects each worker's records
(index → RequestRecord) and end time; the window is [start, last end]. A worker that fails
or dies ends the run with a ConfigError naming it, never a hang (every wait has a limit).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError
from llmc.runtime.bench.benchmark import ProgressFn
from llmc.runtime.bench.http_client import Endpoint, client
from llmc.runtime.bench.workload import ArrivalSpec, WorkloadRequest, arrival_offsets
from llmc.runtime.records import RequestRecord

STREAMS_PER_WORKER = 64
"""``auto`` (``workers == 0``): one client process per this many concurrent streams."""
READY_TIMEOUT_S = 120.0
"""Limit on a worker's start (spawn, import, barrier)."""
START_DELAY_S = 0.05


def auto_workers(limit: int, cpu_count: int | None = None) -> int:
    """Client processes for ``limit`` concurrent streams: one per STREAMS_PER_WORKER, at most
    a quarter of the CPU cores (the server may share the host), at least one."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(math.ceil(limit / STREAMS_PER_WORKER), cores // 4, limit))


def stream_limit(arrival: ArrivalSpec, n: int) -> int:
    """Requests in flight at most: the concurrency, or every request (offline)."""
    return max(1, int(arrival.concurrency or 1)) if arrival.mode == "concurrency" else max(1, n)


def shares(limit: int, workers: int) -> list[int]:
    """``limit`` streams over ``workers`` (the first ``limit % workers`` take one more)."""
    return [limit // workers + (w < limit % workers) for w in range(workers)]


def run_sharded(
    endpoint: Endpoint,
    reqs: Sequence[WorkloadRequest],
    arrival: ArrivalSpec,
    workers: int,
    progress: ProgressFn | None,
) -> tuple[list[RequestRecord], float, float]:
    """The measured requests over ``workers`` processes: (records in request order, start,
    end), as ``http_driver._drive`` returns for one process."""
    ctx = mp.get_context("spawn")
    n = len(reqs)
    offsets = arrival_offsets(n, arrival)
    limits = shares(stream_limit(arrival, n), workers)
    counter, done = ctx.Value("l", 0), ctx.Value("l", 0)
    start_at = ctx.Value("d", 0.0)
    barrier = ctx.Barrier(workers + 1)
    results: Any = ctx.Queue()
    shared = _Shared(counter, done, start_at, barrier, results)
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(_Job(w, workers, endpoint, list(reqs), offsets, limits[w]), shared),
            name=f"llmc-bench-client-{w}",
            daemon=True,
        )
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        try:
            barrier.wait(READY_TIMEOUT_S)
        except Exception:
            raise ConfigError(_dead(procs, "did not start")) from None
        start = time.perf_counter() + START_DELAY_S
        start_at.value = start
        records: dict[int, RequestRecord] = {}
        end = start
        pending = workers
        while pending:
            if progress is not None:
                progress(done.value, n)
            try:
                kind, w, payload = results.get(timeout=0.2)
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
                    raise ConfigError(_dead(procs, "died")) from None
                continue
            if kind == "error":
                raise ConfigError(f"bench client worker {w} failed: {payload}")
            got, worker_end = payload
            records.update(got)
            end = max(end, worker_end)
            pending -= 1
        if progress is not None:
            progress(done.value, n)
    except BaseException:
        for p in procs:  # the others may wait on a server that never answers
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [records[i] for i in range(n)], start, end


def _dead(procs: list[Any], what: str) -> str:
    bad = [f"{i} (exit code {p.exitcode})" for i, p in enumerate(procs) if not p.is_alive()]
    return f"bench client worker {', '.join(bad) or '?'} {what}"


@dataclass(frozen=True)
class _Job:
    """What one client process sends: worker ``w`` of ``workers``, ``limit`` streams."""

    w: int
    workers: int
    endpoint: Endpoint
    reqs: list[WorkloadRequest]
    offsets: list[float] | None
    limit: int


@dataclass(frozen=True)
class _Shared:
    """The parent's shared objects: next request index, finished count, start time, the
    start barrier, the results queue."""

    counter: Any
    done: Any
    start_at: Any
    barrier: Any
    results: Any


def _worker_main(job: _Job, sh: _Shared) -> None:
    """One client process: its share of the requests, its records back to the parent."""
    try:
        got, end = asyncio.run(_worker(job, sh))
        sh.results.put(("ok", job.w, (got, end)))
    except BaseException as e:  # reported to the parent, which raises it by name
        sh.results.put(("error", job.w, f"{type(e).__name__}: {e}"))


async def _worker(job: _Job, sh: _Shared) -> tuple[dict[int, RequestRecord], float]:
    reqs, counter, done, start_at = job.reqs, sh.counter, sh.done, sh.start_at
    got: dict[int, RequestRecord] = {}
    async with client(job.endpoint, max(1, job.limit)) as send:

        async def run(i: int) -> None:
            rec = RequestRecord(
                request_id=i, arrival_time=0.0, num_prompt_tokens=reqs[i].input_len or 0
            )
            got[i] = rec
            await send(reqs[i], rec)
            with done.get_lock():
                done.value += 1

        sh.barrier.wait(READY_TIMEOUT_S)
        while start_at.value == 0.0:
            await asyncio.sleep(0.001)
        start = start_at.value
        if (wait := start - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        if job.offsets is not None:
            tasks = []
            for i in range(job.w, len(reqs), job.workers):
                if (wait := start + job.offsets[i] - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.ensure_future(run(i)))
            await asyncio.gather(*tasks)
        else:

            def take() -> int | None:
                with counter.get_lock():
                    i = counter.value
                    if i >= len(reqs):
                        return None
                    counter.value = i + 1
                    return i

            async def stream() -> None:
                while (i := take()) is not None:
                    await run(i)

            await asyncio.gather(*(stream() for _ in range(job.limit)))
    return got, time.perf_counter()
