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
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.bench.benchmark import ProgressFn, WorkloadRun
from llmc.runtime.bench.sse_client import SSEError, SSEPool
from llmc.runtime.bench.workload import ArrivalSpec, WorkloadRequest, arrival_offsets
from llmc.runtime.records import RequestRecord

MAX_ERROR_CHARS = 300
PLAIN_HTTP_CLIENT = True
"""http:// through ``sse_client`` (False: aiohttp, as for https://; the overhead script
``scripts/serve_client_overhead.py --client aiohttp`` compares the two)."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its ``/v1`` base URL, the model to ask for, its key."""

    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"url {self.url!r} must start with http:// or https://")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must name the model the server serves (--model NAME)")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @property
    def completions_url(self) -> str:
        return self.url + "/completions"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def request_body(endpoint: Endpoint, w: WorkloadRequest) -> bytes:
    """The streamed completion request of one workload request."""
    prompt: Any = list(w.prompt_token_ids) if w.prompt_token_ids is not None else w.prompt
    body = {
        "model": endpoint.model,
        "prompt": prompt,
        "max_tokens": w.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


def _carries_output(choice: dict[str, Any]) -> bool:
    return choice.get("finish_reason") is None or bool(choice.get("text"))


async def _fill(rec: RequestRecord, events: AsyncIterator[tuple[float, bytes]]) -> None:
    """Fill ``rec`` from a stream's ``data:`` payloads (each with the time it was read),
    read to the stream's end (so that its connection can be reused)."""
    chunks = 0
    usage: dict[str, Any] | None = None
    async for now, data in events:
        if rec.finish_time is not None or rec.error is not None:
            continue  # after [DONE] or an error event: read on to the end
        if data == b"[DONE]":
            rec.finish_time = now
            continue
        obj = json.loads(data)
        if "error" in obj:
            rec.error = f"error event: {json.dumps(obj['error'])[:MAX_ERROR_CHARS]}"
            continue
        for choice in obj.get("choices") or ():
            if _carries_output(choice):
                if rec.first_token_time is None:
                    rec.first_token_time = now
                rec.token_times.append(now)
                chunks += 1
            if choice.get("finish_reason") is not None:
                rec.finish_reason = str(choice["finish_reason"])
        if obj.get("usage"):
            usage = obj["usage"]
    if rec.error is not None:
        return
    if rec.finish_time is None:
        rec.error = "the stream ended without data: [DONE]"
        return
    if usage is not None:
        rec.num_prompt_tokens = int(usage.get("prompt_tokens") or rec.num_prompt_tokens)
        rec.num_output_tokens = int(usage.get("completion_tokens") or 0)
    else:
        rec.num_output_tokens = chunks


async def _aiohttp_events(resp: Any) -> AsyncIterator[tuple[float, bytes]]:
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield time.perf_counter(), line[5:].strip()


ERRORS: tuple[type[BaseException], ...] = (
    SSEError,
    asyncio.TimeoutError,
    json.JSONDecodeError,
    OSError,
    ValueError,
    asyncio.IncompleteReadError,
    asyncio.LimitOverrunError,
)


def _failed(rec: RequestRecord, e: BaseException) -> None:
    rec.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


async def _one_aiohttp(
    session: Any, endpoint: Endpoint, w: WorkloadRequest, rec: RequestRecord
) -> None:
    """Send one request with aiohttp (https) and fill its record (never raises)."""
    import aiohttp

    rec.arrival_time = time.perf_counter()
    try:
        async with session.post(
            endpoint.completions_url, data=request_body(endpoint, w), headers=endpoint.headers()
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:MAX_ERROR_CHARS]
                rec.error = f"HTTP {resp.status}: {text}"
                return
            await _fill(rec, _aiohttp_events(resp))
    except (aiohttp.ClientError, *ERRORS) as e:
        _failed(rec, e)


async def _one_plain(
    pool: SSEPool, endpoint: Endpoint, w: WorkloadRequest, rec: RequestRecord
) -> None:
    """Send one request over a kept-alive plain-TCP connection (``sse_client``) and fill
    its record (never raises). Arrival is taken before the connection is acquired, as
    aiohttp's is."""
    request = pool.request_bytes("/completions", request_body(endpoint, w), endpoint.headers())
    rec.arrival_time = time.perf_counter()
    conn = None

    async def exchange() -> None:
        nonlocal conn
        conn = await pool.acquire()
        status, _ = await conn.post(request)
        if status != 200:
            text = (await conn.read_all()).decode("utf-8", "replace")[:MAX_ERROR_CHARS]
            rec.error = f"HTTP {status}: {text}"
            return
        await _fill(rec, conn.events())

    try:
        await asyncio.wait_for(exchange(), endpoint.timeout_s)
    except ERRORS as e:
        _failed(rec, e)
    finally:
        if conn is not None:
            pool.release(conn)


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
    async with _client(endpoint, limit) as send:
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


@contextlib.asynccontextmanager
async def _client(endpoint: Endpoint, limit: int) -> AsyncIterator[Any]:
    """``send(workload request, record)`` over plain TCP (``sse_client``) for http://, or
    aiohttp for https:// (TLS), with at most ``limit`` connections."""
    if PLAIN_HTTP_CLIENT and endpoint.url.startswith("http://"):
        pool = SSEPool(endpoint.url)
        try:
            yield lambda w, rec: _one_plain(pool, endpoint, w, rec)
        finally:
            pool.close()
        return
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=endpoint.timeout_s)
    connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield lambda w, rec: _one_aiohttp(session, endpoint, w, rec)


def run_http_workload(
    endpoint: Endpoint,
    requests: Sequence[WorkloadRequest],
    arrival: ArrivalSpec,
    *,
    warmup: Sequence[WorkloadRequest] = (),
    progress: ProgressFn | None = None,
) -> WorkloadRun:
    """Run the warm-up (excluded), then the measured requests in ``arrival`` mode, over
    HTTP; the records are the client's (no engine steps)."""
    if warmup:
        asyncio.run(_drive(endpoint, warmup, ArrivalSpec(), None, -len(warmup)))
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
) -> Any:
    """One benchmark of ``settings`` (driver.BenchSettings) against ``endpoint``: the
    BenchResult, aggregated from the client's records exactly as in-process runs are."""
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
    log(
        f"endpoint {endpoint.url} model {endpoint.model}: {len(reqs)} requests + "
        f"{len(warm)} warm-up, {settings.arrival.describe()}"
    )
    run = run_http_workload(endpoint, reqs, settings.arrival, warmup=warm, progress=progress)
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
    }
    return BenchResult(config=config, environment=env, aggregates=agg, requests=request_rows(run))
