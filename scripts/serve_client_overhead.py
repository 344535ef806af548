"""The HTTP bench client's own overhead: ``llmc bench --url``'s driver against a fake server.

The fake OpenAI server (raw asyncio, its own process) streams like an engine: every
``--step_ms`` one "step" sends one pre-encoded completion chunk to every open stream (a new
request joins at the next step), ``--osl`` chunks, then the usage chunk and ``[DONE]``. It
costs next to nothing per chunk, so what the client measures beyond the server's send
times is the client's own cost (its event loop, HTTP and SSE parsing) plus the loopback:

- ``first lag``: the client's first-token time minus the server's send time of the first
  chunk (perf_counter is CLOCK_MONOTONIC on Linux: one clock for both processes);
- ``chunk lag``: the same for every chunk (p50 / p99): a client that falls behind at many
  streams shows a lag growing with the step's number of streams;
- ``send``: the client's arrival time to the server's parse of the request;
- the client's CPU time per chunk and its share of one core.

``--client aiohttp`` measures aiohttp instead of the driver's plain-TCP client (``sse_client``);
``--workers N`` sends from N client processes (``llmc bench --client_workers``; their CPU
time counts in the share; the spawn and start of the processes is inside the wall time).

    PYTHONSAFEPATH=1 .venv/bin/python scripts/serve_client_overhead.py --concurrency 1 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from typing import Any

from llmc.runtime.bench.http_driver import Endpoint, run_http_workload
from llmc.runtime.bench.workload import ArrivalSpec, SyntheticSpec, synthetic_workload

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
CHUNK = (
    b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    b'"created":0,"model":"fake","choices":[{"index":0,"text":" tok","logprobs":null,'
    b'"finish_reason":null}],"usage":null}\n\n'
)
LAST = CHUNK.replace(b'"finish_reason":null', b'"finish_reason":"length"')


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


class FakeServer:
    """The server side: streams in lock-step ticks; logs its send times per request."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: list[list[Any]] = []  # [writer, chunks left, key, usage chunk]
        self.log: dict[str, dict[str, Any]] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            if lines[0].startswith("GET /log"):
                data = json.dumps(self.log).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
                continue
            req = json.loads(body)
            key = str(hash(tuple(req["prompt"])))
            self.log[key] = {"parsed": time.perf_counter(), "sent": []}
            usage = {"prompt_tokens": len(req["prompt"]), "completion_tokens": req["max_tokens"]}
            tail = (
                b'data: {"choices":[],"usage":%s}\n\ndata: [DONE]\n\n' % json.dumps(usage).encode()
            )
            writer.write(HEAD)
            done = asyncio.get_running_loop().create_future()
            self.streams.append([writer, req["max_tokens"], key, tail, done])
            await done

    async def ticker(self) -> None:
        nxt = time.perf_counter()
        while True:
            nxt += self.step_s
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            now = time.perf_counter()
            keep = []
            for s in self.streams:
                writer, left, key, tail, done = s
                s[1] = left - 1
                body = CHUNK if left > 1 else LAST + tail
                writer.write(_chunked(body) + (b"0\r\n\r\n" if left == 1 else b""))
                self.log[key]["sent"].append(now)
                if left > 1:
                    keep.append(s)
                else:
                    done.set_result(None)
            self.streams = keep

    async def main(self, port_file: str) -> None:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".tmp", port_file)
        asyncio.get_running_loop().create_task(self.ticker())
        async with server:
            await server.serve_forever()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_s() -> float:  # this process and its finished children (the client workers)
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        u = resource.getrusage(who)
        total += u.ru_utime + u.ru_stime
    return total


def measure(
    port: int, concurrency: int, num: int, osl: int, workers: int, plain: bool
) -> dict[str, float]:
    spec = SyntheticSpec(num_requests=num, isl=128, osl=osl, seed=concurrency)
    reqs = synthetic_workload(spec, 128000)
    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "fake", plain_http=plain)
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    run = run_http_workload(
        endpoint, reqs, ArrivalSpec(mode="concurrency", concurrency=concurrency), workers=workers
    )
    wall = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/log", timeout=30) as r:
        log = json.loads(r.read())
    first, chunk, send = [], [], []
    failed = sum(rec.error is not None for rec in run.requests)
    for w, rec in zip(reqs, run.requests, strict=True):
        entry = log.get(str(hash(tuple(w.prompt_token_ids or ()))))
        if entry is None or rec.error is not None:
            continue
        sent = entry["sent"]
        send.append(entry["parsed"] - rec.arrival_time)
        first.append(rec.first_token_time - sent[0])
        chunk += [t - s for t, s in zip(rec.token_times, sent, strict=False)]
    chunks = sum(len(r.token_times) for r in run.requests)
    return {
        "concurrency": concurrency,
        "requests": num,
        "failed": failed,
        "wall_s": wall,
        "chunks_per_s": chunks / wall,
        "client_cpu_share": cpu / wall,
        "cpu_us_per_chunk": cpu / max(1, chunks) * 1e6,
        "send_p50_ms": _pct(send, 0.5) * 1e3,
        "first_lag_p50_ms": _pct(first, 0.5) * 1e3,
        "chunk_lag_p50_ms": _pct(chunk, 0.5) * 1e3,
        "chunk_lag_p99_ms": _pct(chunk, 0.99) * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--requests", type=int, nargs="+", help="per concurrency (default 4 x it)")
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--step_ms", type=float, default=15.0)
    ap.add_argument("--fake_server", help=argparse.SUPPRESS)  # internal: run the server
    ap.add_argument("--client", choices=("plain", "aiohttp"), default="plain")
    ap.add_argument("--workers", type=int, default=1, help="client processes (--client_workers)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    if args.fake_server:
        asyncio.run(FakeServer(args.step_ms / 1e3).main(args.fake_server))
        return 0
    port_file = f"/tmp/llmc-fake-server-{os.getpid()}"
    cmd = [sys.executable, __file__, "--fake_server", port_file, "--step_ms", str(args.step_ms)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONSAFEPATH": "1"})
    rows = []
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
        counts = args.requests or [max(16, 4 * c) for c in args.concurrency]
        for c, n in zip(args.concurrency, counts, strict=True):
            row = measure(port, c, n, args.osl, args.workers, args.client == "plain")
            row["client"] = args.client
            row["workers"] = args.workers
            rows.append(row)
            print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in row.items()))  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(10)
        if os.path.exists(port_file):
            os.remove(port_file)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_ms": args.step_ms, "osl": args.osl, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
