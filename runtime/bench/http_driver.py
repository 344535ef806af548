"""The HTTP driver: a workload sent to an OpenAI-compatible endpoint, timed from the client.

``run_http_workload`` is the HTTP twin of ``benchmark.run_workload``: the same workload
requests and arrival modes (offline: all at once; concurrency N: N in flight; request_rate:
gamma arrivals), the warm-up first and excluded, and the result as ``RequestRecord``s so
that ``metrics.aggregate`` computes every number the in-process run has. Each request is a
streamed ``POST {url}/completions`` (http://: ``sse_client``'s kept-alive plain TCP
connections, one pre-encoded write per request, so that the client's own cost stays small
inside what it times; https://: aiohttp): the prompt's token ids
(text when the workload has no ids), ``max_tokens`` = the request's output length,
``temperature`` 0, ``ignore_eos`` (vLLM's, TensorRT-LLM's and llmc's extension, so outputs
have exactly that length) and ``stream_options.include_usage``.

Times are the client's ``perf_counter`` seconds: arrival = the request is sent; first token
= the first chunk with a choice that carries output (a text delta, even an empty one
without a finish reason); ``token_times`` = one entry per such chunk (ITL is between chunks,
as in vLLM's ``bench serve``; a server that sends several tokens per chunk shows fewer,
longer gaps), finish = ``data: [DONE]``. Token counts come from the final ``usage``
(the number of chunks when the server sends none). A request fails on a non-200 status, an
error event, a broken stream or ``timeout_s``; its error names the status and the server's
message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.bench import http_workers
from llmc.runtime.bench.benchmark import ProgressFn, WorkloadRun
from llmc.runtime.bench.http_client import Endpoint, client
from llmc.runtime.bench.workload import ArrivalSpec, WorkloadRequest, arrival_offsets
from llmc.runtime.records import RequestRecord

__all__ = ["ClientModel", "Endpoint", "client_model", "run_bench_http", "run_http_workload"]


async def _drive(
    endpoint: Endpoint,
    reqs: Sequence[WorkloadRequest],
    arrival: ArrivalSpec,
    progress: ProgressFn | None,
    first_id: int,
) -> tuple[list[RequestRecord], float, float]:
    limit = arrival.concurrency if arrival.mode == "concurrency" else len(reqs)
    limit = max(1, int(limit or 1))
    records = [
        RequestRecord(request_id=first_id + i, arrival_time=0.0, num_prompt_tokens=w.input_len or 0)
        for i, w in enumerate(reqs)
    ]
    async with client(endpoint, limit) as send:
        done = 0

        async def run(i: int) -> None:
            nonlocal done
            await send(reqs[i], records[i])
            done += 1
            if progress is not None:
                progress(done, len(reqs))

        start = time.perf_counter()
        if arrival.mode == "request_rate":
            offsets = arrival_offsets(len(reqs), arrival)
            assert offsets is not None
            tasks = []
            for i, off in enumerate(offsets):
                if (wait := start + off - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.ensure_future(run(i)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(range(len(reqs)))

            async def worker() -> None:
                for i in queue:
                    await run(i)

            await asyncio.gather(*(worker() for _ in range(limit)))
        end = time.perf_counter()
    return records, start, end


def run_http_workload(
    endpoint: Endpoint,
    requests: Sequence[WorkloadRequest],
    arrival: ArrivalSpec,
    *,
    warmup: Sequence[WorkloadRequest] = (),
    progress: ProgressFn | None = None,
    workers: int = 1,
) -> WorkloadRun:
    """Run the warm-up (excluded), then the measured requests in ``arrival`` mode, over
    HTTP; the records are the client's (no engine steps). ``workers`` > 1: the measured
    requests from that many client processes (``http_workers``; at most one per stream)."""
    if warmup:
        asyncio.run(_drive(endpoint, warmup, ArrivalSpec(), None, -len(warmup)))
    workers = min(workers, http_workers.stream_limit(arrival, len(requests)))
    if workers > 1:
        records, start, end = http_workers.run_sharded(
            endpoint, requests, arrival, workers, progress
        )
    else:
        records, start, end = asyncio.run(_drive(endpoint, requests, arrival, progress, 0))
    task_ids = {r.request_id: w.task_id for r, w in zip(records, requests, strict=True)}
    return WorkloadRun(records, [], task_ids, start, end)


# ---- one benchmark over HTTP -------------------------------------------------------------
@dataclass(frozen=True)
class ClientModel:
    """What the client knows of the served model: enough to make the workload."""

    vocab_size: int | None
    tokenizer: Any
    limits: tuple[int, int] | None
    """(max_input_len, max_seq_len), when an engine directory was given."""


def client_model(engine_dir: str | None, tokenizer_dir: str | None) -> ClientModel:
    """The served engine's vocabulary, tokenizer and limits read from its directory (no
    weights are read), or a tokenizer alone; neither: text datasets only."""
    from llmc.runtime.tokenizer import Tokenizer

    if engine_dir is not None:
        from llmc.compiler.engine_format import load_engine

        eng = load_engine(engine_dir, verify_checksums=False)
        tok = Tokenizer.from_dir(eng.tokenizer_path) if eng.tokenizer_path else None
        lim = eng.build.limits
        return ClientModel(eng.spec.vocab_size, tok, (lim.max_input_len, lim.max_seq_len))
    if tokenizer_dir is not None:
        tok = Tokenizer.from_dir(tokenizer_dir)
        return ClientModel(tok.vocab_size, tok, None)
    return ClientModel(None, None, None)


def run_bench_http(
    endpoint: Endpoint,
    settings: Any,
    model: ClientModel,
    *,
    log: Any = lambda m: None,
    progress: ProgressFn | None = None,
    workers: int = 1,
) -> Any:
    """One benchmark of ``settings`` (driver.BenchSettings) against ``endpoint``: the
    BenchResult, aggregated from the client's records exactly as in-process runs are.
    ``workers``: client processes (0: ``http_workers.auto_workers`` of the stream limit)."""
    from llmc.runtime.bench.benchmark import BenchResult, aggregate_run, environment, request_rows
    from llmc.runtime.bench.driver import build_requests, workload_config

    if not settings.sampling.is_greedy:
        raise UsageError(
            "--temperature, --n or --beam_width with --url: the HTTP driver sends greedy requests"
        )
    if settings.peer is not None:
        raise ConfigError("--peer runs in-process only; it cannot be combined with --url")
    warm, reqs = build_requests(
        settings, model.vocab_size, model.tokenizer, model.limits, need_ids=False
    )
    limit = http_workers.stream_limit(settings.arrival, len(reqs))
    workers = min(workers or http_workers.auto_workers(limit), limit)
    log(
        f"endpoint {endpoint.url} model {endpoint.model}: {len(reqs)} requests + "
        f"{len(warm)} warm-up, {settings.arrival.describe()}, {workers} client "
        f"process{'es' if workers > 1 else ''}"
    )
    run = run_http_workload(
        endpoint, reqs, settings.arrival, warmup=warm, progress=progress, workers=workers
    )
    agg = aggregate_run(run, settings.percentiles, None)
    env = {**environment("cpu"), "device": "client"}
    config = {
        "endpoint": {"url": endpoint.url, "model": endpoint.model},
        "engine_dir": None,
        "workload": workload_config(settings, warm, reqs),
        "arrival": {
            **dataclasses.asdict(settings.arrival),
            "description": settings.arrival.describe(),
        },
        "percentiles": list(settings.percentiles),
        "client_workers": workers,
    }
    return BenchResult(config=config, environment=env, aggregates=agg, requests=request_rows(run))
