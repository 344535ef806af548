"""Where a concurrency-1 first token's time goes inside one process, without HTTP (issue 15).

On the H200 the served first token (``llmc serve``, concurrency 1) spends ~4 ms more in the
engine's first step ("compute": first scheduled → first token on the host) than the same
engine stepped by ``llmc bench`` in the caller's thread. This script loads one engine and
runs the same closed-loop, one-at-a-time streamed requests through arms that add the
server's ingredients one by one, alternating short rounds so drift hits every arm alike:

- ``caller``: ``LLM.in_caller_thread`` (the bench's path: the waiting thread runs the steps);
- ``loop``: the background engine thread, the main thread waiting on ``await_responses``;
- ``sink``: the background engine thread posting each step's Responses to an asyncio loop
  in a second thread (``Executor.set_response_sink`` + ``call_soon_threadsafe``, as
  llmc/serve/bridge.py), the main thread submitting through that loop (the server's shape);
- ``sink_si``: ``sink`` with the server's GIL switch interval (llmc/serve/server.py);
- ``sink_gap``: ``sink_si`` with a 1 ms pause between a request's end and the next one
  (the HTTP round trip's idle gap, when the engine thread sleeps).

Per arm: medians of queue (arrival → first scheduled), compute (→ first token on the host)
and TTFT, from the engine's own request records. ``--json FILE`` writes them.

    python3 scripts/ttft_probe.py --engine_dir /tmp/llmc-engines/llama3-8b --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from typing import Any

from llmc import LLM
from llmc.runtime.types import Request, SamplingParams

SERVER_SWITCH_INTERVAL_S = 0.0005  # llmc/serve/server.py SWITCH_INTERVAL_S
ARMS = ("caller", "loop", "sink", "sink_si", "sink_gap")


def _prompts(n: int, isl: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(isl)] for _ in range(n)]


def _request(ids: list[int], osl: int) -> Request:
    sp = SamplingParams(max_new_tokens=osl, ignore_eos=True)
    return Request(prompt_token_ids=ids, sampling=sp, streaming=True)


def _wait_final(llm: LLM, rid: int) -> None:
    while True:
        got = llm.await_responses(rid, timeout=60.0)
        if not got:
            raise RuntimeError(f"request {rid}: no response within 60 s")
        if any(r.is_final for r in got):
            return


class _SinkLoop:
    """An asyncio loop in a thread receiving the engine's Responses, as the server's bridge."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.loop = asyncio.new_event_loop()
        self.done: dict[int, asyncio.Future[None]] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        llm.executor.set_response_sink(self._post)

    def _post(self, batch: list[Any]) -> None:
        self.loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[Any]) -> None:
        for r in batch:
            fut = self.done.get(r.request_id)
            if fut is not None and r.is_final and not fut.done():
                fut.set_result(None)

    async def _one(self, req: Request) -> None:
        rid = self.llm.enqueue_request(req)
        fut = self.done[rid] = self.loop.create_future()
        await fut
        del self.done[rid]

    def run(self, req: Request) -> None:
        asyncio.run_coroutine_threadsafe(self._one(req), self.loop).result(60.0)

    def close(self) -> None:
        self.llm.executor.set_response_sink(None)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)


def _arm(llm: LLM, arm: str, prompts: list[list[int]], osl: int) -> list[int]:
    ids: list[int] = []
    if arm == "caller":
        with llm.in_caller_thread():
            for p in prompts:
                rid = llm.enqueue_request(_request(p, osl))
                _wait_final(llm, rid)
                ids.append(rid)
        return ids
    if arm == "loop":
        for p in prompts:
            rid = llm.enqueue_request(_request(p, osl))
            _wait_final(llm, rid)
            ids.append(rid)
        return ids
    sink = _SinkLoop(llm)
    previous = sys.getswitchinterval()
    if arm in ("sink_si", "sink_gap"):
        sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    try:
        before = {r.request_id for r in llm.request_records}
        for p in prompts:
            sink.run(_request(p, osl))
            if arm == "sink_gap":
                time.sleep(0.001)
        ids = [r.request_id for r in llm.request_records if r.request_id not in before]
    finally:
        sys.setswitchinterval(previous)
        sink.close()
    return ids


def _ms(xs: list[float]) -> float | None:
    return round(1e3 * statistics.median(xs), 3) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8, help="per arm and round")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with LLM(engine_dir=args.engine_dir, device=args.device) as llm:
        vocab = llm.runtime.vocab_size
        warm = _prompts(4, args.isl, vocab, seed=99)
        for arm in ARMS:  # warm every path (graphs, allocator, loop) before measuring
            _arm(llm, arm, warm[:1], args.osl)
        by_arm: dict[str, list[int]] = {a: [] for a in ARMS}
        for rnd in range(args.rounds):
            for k, arm in enumerate(ARMS):
                ps = _prompts(args.requests, args.isl, vocab, seed=1000 * rnd + k)
                by_arm[arm] += _arm(llm, arm, ps, args.osl)
        recs = {r.request_id: r for r in llm.request_records}
        out: dict[str, Any] = {}
        for arm, ids in by_arm.items():
            rs = [recs[i] for i in ids]
            out[arm] = {
                "requests": len(rs),
                "queue_ms": _ms([r.scheduled_time - r.arrival_time for r in rs]),
                "compute_ms": _ms([r.first_token_time - r.scheduled_time for r in rs]),
                "ttft_ms": _ms([r.first_token_time - r.arrival_time for r in rs]),
            }
    print("| arm | requests | queue ms | compute ms | TTFT ms |")
    print("|---|---:|---:|---:|---:|")
    for arm, v in out.items():
        print(f"| {arm} | {v['requests']} | {v['queue_ms']} | {v['compute_ms']} | {v['ttft_ms']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
