"""The bench client's plain-TCP SSE client (runtime/bench/sse_client.py) and the HTTP
driver on it, against scripted raw-socket servers on 127.0.0.1: body framings (chunked,
Content-Length, until close), events split across reads, keep-alive reuse, and every
failure recorded, never raised. Every wait is bounded."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmc.runtime.bench.http_driver import Endpoint, run_http_workload
from llmc.runtime.bench.sse_client import SSEError, SSEPool
from llmc.runtime.bench.workload import ArrivalSpec, WorkloadRequest

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def completion(text: str, reason: str | None = None) -> bytes:
    obj = {"choices": [{"index": 0, "text": text, "finish_reason": reason}], "usage": None}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _serve(answers: list[bytes], seen: list[bytes]):
    """A server answering the n-th request on any connection with ``answers[n]`` (a
    trailing b"<close>" closes the connection after it)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")]
            body = await reader.readexactly(int(length[0].split(b":")[1])) if length else b""
            seen.append(head + body)
            answer = answers.pop(0)
            close = answer.endswith(b"<close>")
            writer.write(answer.removesuffix(b"<close>"))
            await writer.drain()
            if close:
                break
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _run(answers: list[bytes], client) -> tuple[object, list[bytes]]:
    seen: list[bytes] = []

    async def main():
        server = await _serve(answers, seen)
        port = server.sockets[0].getsockname()[1]
        try:
            return await asyncio.wait_for(client(port), 20)
        finally:
            server.close()

    return asyncio.run(main()), seen


def test_chunked_events_split_across_reads_and_the_connection_is_reused() -> None:
    first = completion("a") + completion("b", "length")
    stream = (
        SSE_HEAD + chunk(first[:7]) + chunk(first[7:-1])
        + chunk(first[-1:] + b"data: [DONE]\r\n\r\n") + b"0\r\n\r\n"
    )  # fmt: skip

    async def client(port: int):
        pool = SSEPool(f"http://127.0.0.1:{port}/v1")
        got, conns = [], []
        for _ in range(2):
            conn = await pool.acquire()
            conns.append(conn)
            status, headers = await conn.post(pool.request_bytes("/completions", b"{}", {}))
            assert status == 200 and headers["content-type"] == "text/event-stream"
            got.append([data async for _, data in conn.events()])
            pool.release(conn)
        pool.close()
        return got, conns[0] is conns[1]

    (got, reused), seen = _run([stream, stream], client)
    assert reused
    for events in got:
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        assert events[2] == b"[DONE]"
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Content-Length: 2\r\n" in seen[0] and seen[0].endswith(b"\r\n\r\n{}")


def test_other_framings_and_a_closing_server() -> None:
    sized = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"
    until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + completion("x") + b"<close>"

    async def client(port: int):
        pool = SSEPool(f"http://127.0.0.1:{port}")
        conn = await pool.acquire()
        status, _ = await conn.post(pool.request_bytes("/a", b"", {}))
        body = await conn.read_all()
        assert conn.reusable
        pool.release(conn)
        conn2 = await pool.acquire()
        assert conn2 is conn
        await conn2.post(pool.request_bytes("/b", b"", {}))
        events = [data async for _, data in conn2.events()]
        assert not conn2.reusable
        pool.release(conn2)
        pool.close()
        return status, body, events

    (status, body, events), _ = _run([sized, until_close], client)
    assert (status, body) == (503, b"busy")
    assert [json.loads(e)["choices"][0]["text"] for e in events] == ["x"]


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"SPDY/3 200 OK\r\n\r\n<close>", SSEError),
        (b"<close>", SSEError),
        (SSE_HEAD + b"40\r\ndata: {}<close>", asyncio.IncompleteReadError),
    ],
)
def test_broken_answers_raise_clear_errors(answer: bytes, error: type) -> None:
    async def client(port: int):
        pool = SSEPool(f"http://127.0.0.1:{port}")
        conn = await pool.acquire()
        try:
            await conn.post(pool.request_bytes("/x", b"", {}))
            [_ async for _ in conn.events()]
        finally:
            pool.release(conn)
            assert not pool._idle  # a connection that failed is never reused

    with pytest.raises(error):
        _run([answer], client)


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="http://"):
        SSEPool("https://example.com/v1")


def _workload(n: int) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(task_id=str(i), prompt=None, prompt_token_ids=(1, 2, 3), output_tokens=2)
        for i in range(n)
    ]


@pytest.mark.parametrize("plain", [True, False])
def test_driver_records_tokens_and_failures_on_both_clients(plain: bool) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    ok = (
        SSE_HEAD + chunk(completion("a") + completion("b", "length"))
        + chunk(b'data: {"choices": [], "usage": ' + json.dumps(usage).encode() + b"}\n\n")
        + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    )  # fmt: skip
    refused = b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 13\r\n\r\n{"error": {}}'
    event = (
        SSE_HEAD + chunk(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n') + b"0\r\n\r\n"
    )
    truncated = SSE_HEAD + chunk(completion("a")) + b"<close>"
    answers = [ok, refused, event, truncated]

    async def client(port: int):
        endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "m", timeout_s=10, plain_http=plain)
        return await asyncio.to_thread(
            run_http_workload, endpoint, _workload(4), ArrivalSpec("concurrency", 1)
        )

    run, seen = _run(answers, client)
    assert len(seen) == 4
    good, busy, err, cut = run.requests
    assert good.error is None and good.num_output_tokens == 2 and len(good.token_times) == 2
    assert good.arrival_time < good.first_token_time <= good.finish_time
    assert busy.error.startswith("HTTP 503")
    assert "boom" in err.error
    assert "without data: [DONE]" in cut.error or "Error" in cut.error
