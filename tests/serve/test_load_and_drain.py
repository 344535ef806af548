"""`llmc serve` under load and faults: 200 concurrent streams of which 10 % disconnect, a
full queue (503 + Retry-After), and SIGTERM draining without losing an in-flight request.
Every loop is bounded in count and time; the servers run on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time

import aiohttp

from helpers.server import metric, metrics, post_json, request

PROMPTS = ["ab", "cd", "ef", "gh"]


async def _stream(session, url: str, prompt: str, max_tokens: int, leave: bool) -> str | None:
    """The streamed text; for a client that leaves after its first chunk, None, or "served"
    when that chunk already finished the request (a server that fell behind the engine
    merges a choice's deltas: on a loaded machine a whole answer can be one chunk)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    text = ""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if leave:
                resp.close()  # the connection drops mid-stream
                return None if choice["finish_reason"] is None else "served"
    raise AssertionError("stream ended without [DONE]")


def _wait_idle(port: int, timeout: float = 30.0) -> dict:
    """/metrics once nothing runs, waits or holds KV blocks (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(port)
        busy = sum(
            metric(m, name)
            for name in (
                "llmc_requests_running", "llmc_requests_waiting", "llmc_kv_cache_blocks_used",
                "llmc_server_requests_unfinished",
            )
        )  # fmt: skip
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_200_streams_with_10_percent_leaving(start_server, serve_engine) -> None:
    server = start_server("--engine", f"tiny={serve_engine}")
    max_tokens = 24
    expected = {}
    for p in PROMPTS:
        status, _, body = post_json(
            server.port, "/v1/completions",
            {"model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0},
        )  # fmt: skip
        assert status == 200
        expected[p] = body["choices"][0]["text"]
    url = server.base_url + "/completions"

    async def main() -> list[str | None]:
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            jobs = [  # a leaving client asks for more tokens: its request runs on after it left
                _stream(session, url, PROMPTS[i % 4], 100 if i % 10 == 3 else max_tokens,
                        leave=i % 10 == 3)
                for i in range(200)
            ]  # fmt: skip
            return await asyncio.wait_for(asyncio.gather(*jobs), 150)

    t0 = time.monotonic()
    texts = asyncio.run(main())
    assert time.monotonic() - t0 < 150
    left = sum(t is None for t in texts)
    assert left >= 1 and left + sum(t == "served" for t in texts) == 20
    for i, text in enumerate(texts):
        if i % 10 != 3:
            assert text == expected[PROMPTS[i % 4]], i
    m = _wait_idle(server.port)
    assert metric(m, "llmc_requests_running") == 0
    assert metric(m, "llmc_kv_cache_blocks_used") == 0
    assert metric(m, "llmc_server_requests_unfinished") == 0
    assert metric(m, "llmc_requests_total", outcome="cancelled") == left
    assert metric(m, "llmc_requests_total", outcome="success") == 200 - left + len(PROMPTS)


def _open_stream(port: int, body: dict):
    """A streamed request left open: (connection, response) after its headers came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})  # fmt: skip
    return conn, conn.getresponse()


def test_a_full_queue_answers_503_with_retry_after(start_server, serve_engine) -> None:
    server = start_server(
        "--engine", f"tiny={serve_engine}", "--max_batch_size", "1", "--max_queue", "1"
    )
    long = {"model": "tiny", "prompt": "a", "max_tokens": 120, "temperature": 0, "stream": True}
    conn_a, resp_a = _open_stream(server.port, long)  # running (its first chunk came)
    assert resp_a.status == 200 and resp_a.readline().startswith(b"data: ")
    conn_b = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn_b.request("POST", "/v1/completions", json.dumps(long).encode())  # queued behind A
    deadline = time.monotonic() + 10
    while metric(metrics(server.port), "llmc_server_requests_unfinished") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    status, headers, raw = request(
        server.port, "POST", "/v1/completions",
        json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2}).encode(),
    )  # fmt: skip
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(raw)["error"]["code"] == "queue_full"
    for conn in (conn_a, conn_b):
        conn.close()
    m = _wait_idle(server.port)
    assert metric(m, "llmc_requests_total", outcome="rejected") == 1
    assert metric(m, "llmc_kv_cache_blocks_used") == 0


def test_sigterm_drains_in_flight_requests_then_exits_0(start_server, serve_engine) -> None:
    server = start_server("--engine", f"tiny={serve_engine}", "--drain_timeout", "60")
    body = {
        "model": "tiny",
        "prompt": "ab",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, _, whole = post_json(server.port, "/v1/completions", body)
    assert status == 200
    streams = [_open_stream(server.port, {**body, "stream": True}) for _ in range(24)]
    assert all(resp.status == 200 for _, resp in streams)
    first = streams[0][1].readline()  # generation is under way
    assert first.startswith(b"data: ")
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while request(server.port, "GET", "/health")[0] != 503:
        assert time.monotonic() < deadline, server.log
        time.sleep(0.01)
    status, headers, raw = request(
        server.port, "POST", "/v1/completions", json.dumps(body).encode()
    )
    assert status == 503 and "retry-after" in headers, raw
    for n, (conn, resp) in enumerate(streams):  # each in-flight request ends with its text
        raw = (first if n == 0 else b"") + resp.read()
        events = [
            json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: {")
        ]  # fmt: skip
        assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        conn.close()
    assert server.proc.wait(30) == 0, server.log
    assert "draining" in server.log
