"""Why a closed loop through a server loses throughput at high concurrency, with no HTTP.

The real Executor, Scheduler and KV manager over a no-op model (scripts/host_overhead.py's
``build``) on a simulated device whose step time grows with the step's tokens (``--base_ms``
+ ``--per_token_us`` per token: by default an 8B-on-H200-like 11 ms decode step of 256 rows
and ~200 ms for a full 8,192-token mixed step). A closed loop of ``--concurrency`` clients
replaces each finished request:

- ``in-process``: before the next step is scheduled (``llmc bench --concurrency``: the
  engine is stepped by the client's thread);
- ``after L ms``: L ms after the engine emitted the final token (the background loop runs
  on; a server's round trip: final chunk → client → new request → parse → enqueue).

A replacement that misses the step boundary waits for the next step, and when that step is
a long mixed step carrying another group's prefill, it waits a whole long step: its slot is
empty meanwhile, so fewer rows decode per step. Prints output tok/s, TTFT p50 and the mean
decode batch of each variant (and, with ``--max_num_tokens``, of a smaller step budget).

    PYTHONSAFEPATH=1 .venv/bin/python scripts/serve_closed_loop.py --requests 1000
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for host_overhead

import host_overhead  # noqa: E402

from llmc.runtime.types import Request, SamplingParams  # noqa: E402


class TokenTimedDevice(host_overhead.SimulatedDevice):
    """A simulated device whose step takes ``base_s + per_token_s * tokens``."""

    def __init__(self, runner: Any, base_s: float, per_token_s: float) -> None:
        super().__init__(runner)
        self.base_s, self.per_token_s = base_s, per_token_s

    def launch(self, batch: Any, src_rows: list[int] | None = None) -> Any:
        t0 = time.perf_counter()
        pending = self.runner.launch(batch, src_rows)
        tokens = sum(s.num_new_tokens for s in batch.sequences)
        start = max(t0, self._free_at)
        end = max(start + self.base_s + self.per_token_s * tokens, time.perf_counter())
        self._free_at = end
        return host_overhead._SimPending(pending, end)


def _request(i: int, isl: int, osl: int) -> Request:
    ids = [(i * 7919 + j * 104729) % 128000 + 1 for j in range(isl)]
    sp = SamplingParams(max_new_tokens=osl, temperature=0.0, ignore_eos=True)
    return Request(prompt_token_ids=ids, sampling=sp)


def closed_loop(ex: Any, args: argparse.Namespace, latency_s: float | None) -> dict[str, float]:
    """Run the loop; ``latency_s`` None: in-process (replaced before the next step)."""
    n, c = args.requests, args.concurrency
    sent = 0
    t0 = time.perf_counter()
    if latency_s is None:
        inflight: set[int] = set()
        while sent < n or inflight:
            while sent < n and len(inflight) < c:
                inflight.add(ex.enqueue_request(_request(sent, args.isl, args.osl)))
                sent += 1
            for r in ex.await_responses(list(inflight)):
                if r.is_final:
                    inflight.discard(r.request_id)
    else:
        ex.start()
        due: list[float] = []
        open_ = 0
        while sent < n and sent < c:
            ex.enqueue_request(_request(sent, args.isl, args.osl))
            sent, open_ = sent + 1, open_ + 1
        while open_:
            wait = max(0.0, due[0] - time.perf_counter()) if due else 1.0
            for r in ex.await_responses(None, timeout=wait):
                if r.is_final:
                    open_ -= 1
                    if sent < n:
                        heapq.heappush(due, time.perf_counter() + latency_s)
            while due and due[0] <= time.perf_counter():
                heapq.heappop(due)
                ex.enqueue_request(_request(sent, args.isl, args.osl))
                sent, open_ = sent + 1, open_ + 1
        ex.shutdown()
    wall = time.perf_counter() - t0
    recs = ex.request_records
    ttft = [r.first_token_time - r.arrival_time for r in recs]
    decode = [s.batch_size for s in ex.step_records]
    return {
        "output_tok_s": n * args.osl / wall,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "mean_batch": statistics.mean(decode),
        "steps": len(decode),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--base_ms", type=float, default=11.0)
    ap.add_argument("--per_token_us", type=float, default=23.0)
    ap.add_argument("--latency_ms", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--max_num_tokens", type=int, nargs="+", default=[8192])
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"{args.requests} requests {args.isl}/{args.osl} at concurrency {args.concurrency}; "
          f"step {args.base_ms} ms + {args.per_token_us} us/token")  # fmt: skip
    for mnt in args.max_num_tokens:
        base = None
        for lat in (None, *args.latency_ms):
            ns = argparse.Namespace(batch=max(args.concurrency, 8), isl=args.isl, osl=args.osl,
                                    path="graph", async_scheduling=False)  # fmt: skip
            ex = host_overhead.build(
                ns,
                lambda r: TokenTimedDevice(r, args.base_ms / 1e3, args.per_token_us / 1e6),
            )
            _set_budget(ex.scheduler, mnt)
            row = closed_loop(ex, args, None if lat is None else lat / 1e3)
            base = base or row["output_tok_s"]
            name = "in-process" if lat is None else f"after {lat:g} ms"
            print(f"max_num_tokens {mnt:5d}  {name:>13}: {row['output_tok_s']:9.1f} tok/s "
                  f"({row['output_tok_s'] / base * 100:5.1f} %), TTFT p50 "
                  f"{row['ttft_p50_ms']:7.1f} ms, mean batch {row['mean_batch']:6.1f}, "
                  f"{row['steps']} steps")  # fmt: skip
    return 0


def _set_budget(scheduler: Any, max_num_tokens: int) -> None:
    """A smaller per-step token budget than the engine's limits (the runner keeps its own)."""
    import dataclasses

    limits = dataclasses.replace(scheduler.limits, max_num_tokens=max_num_tokens)
    scheduler.limits = limits
    scheduler.config = dataclasses.replace(scheduler.config, limits=limits)


if __name__ == "__main__":
    sys.exit(main())
