"""The HTTP bench client's sending side: the endpoint, one streamed request, its record.

Each request is a streamed ``POST {url}/completions`` (http://: ``sse_client``'s kept-alive
plain TCP connections, one pre-encoded write per request, so that the client's own cost
stays small inside what it times; https://: aiohttp): the prompt's token ids (text when the
workload has no ids), ``max_tokens`` = the request's output length, ``temperature`` 0,
``ignore_eos`` (vLLM's, TensorRT-LLM's and llmc's extension, so outputs have exactly that
length) and ``stream_options.include_usage``. ``http_driver`` runs workloads of them in one
process, ``http_workers`` in several; the record's times are ``http_driver``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError
from llmc.runtime.bench.sse_client import SSEError, SSEPool
from llmc.runtime.bench.workload import WorkloadRequest
from llmc.runtime.records import RequestRecord

MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: its ``/v1`` base URL, the model to ask for, its key."""

    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0
    plain_http: bool = True
    """http:// through ``sse_client`` (False: aiohttp, as for https://; the overhead script
    ``scripts/serve_client_overhead.py --client aiohttp`` compares the two)."""

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


@contextlib.asynccontextmanager
async def client(endpoint: Endpoint, limit: int) -> AsyncIterator[Any]:
    """``send(workload request, record)`` over plain TCP (``sse_client``) for http://, or
    aiohttp for https:// (TLS), with at most ``limit`` connections."""
    if endpoint.plain_http and endpoint.url.startswith("http://"):
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
