"""Host time per engine step, measured on CPU: the real Executor, Scheduler, KVCacheManager and
ModelRunner over a no-op backend, so what is timed is only the host's work per step.

The model has Llama-3-8B's vocabulary and engine limits (tokens_per_block 32, max_seq_len
4096, so block tables are 128 blocks wide) but tiny layers whose ops do nothing; sampling
returns a fixed id (never EOS: requests run to ``--osl``). Two step paths:

- ``--path graph`` (default): decode-only steps go through ``DecodeGraphs`` with a replay
  that does nothing (the CUDA-graph path's host work: staging, replay call, id copy);
- ``--path eager``: every step through ``StepInputBuilder.prepare`` / ``ModelRunner.forward``
  (no-op ops).

Prints µs per phase (median over the decode-only steps after a warm-up), as the profile's
phase table names them: schedule, prepare, forward, sample, update, the whole step (its
record's start to end) and ``iter``, the host time per step of the loop (one step's end to
the next one's: what bounds the steps per second). With ``--async_scheduling`` the phases
are those ``Executor._step_async`` times: schedule is ``schedule_ahead`` (and the rows'
sources), prepare/forward the launch of the step ahead, update the update and responses of
the step in flight; a step's record then spans two loop calls, so ``iter``, not ``step``,
is its host time per step.

    .venv/bin/python scripts/host_overhead.py --batch 128 --isl 128 --osl 256
    .venv/bin/python scripts/host_overhead.py --batch 256 --async_scheduling --profile
    .venv/bin/python scripts/host_overhead.py --batch 1024 --decode_steps_per_iteration 4

With ``--decode_steps_per_iteration K`` (multi-step decoding) the phases are per decode
step: each full window's host time divided by its K steps.

``--latency`` instead runs a closed loop of one request at a time on a *simulated device*
(``SimulatedDevice``: a step's ids reach the host only at launch time + a fixed GPU time per
step, steps executed in order on one simulated stream) and prints TTFT and ITL with async
scheduling off and on (a multi-step window takes K decode times of the simulated device):

    .venv/bin/python scripts/host_overhead.py --latency --isl 128 --osl 64

``--throughput`` runs the offline case on the same simulated device (``--requests`` queued at
once, ``--batch`` the max batch) and prints the run's output tok/s, the device's busy share
and the idle gaps between steps by the kinds of the two steps ("mixed": prompt chunks in
the step; "ahead": scheduled ahead); ``--prefill_ms 0 --decode_ms 0`` gives the host-bound
rate (the 135M shape's row, docs/PERFORMANCE.md); the heap is frozen around the run as
``llmc bench`` freezes it (``--no_freeze``: not), and the run's garbage collections are
counted and timed by generation:

    .venv/bin/python scripts/host_overhead.py --throughput --batch 1024 --requests 4096 \
        --isl 128 --osl 128 --prefill_ms 5 --decode_ms 3
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import statistics
import time
from typing import Any

import torch

from llmc.compiler.limits import EngineLimits
from llmc.compiler.spec import ModelSpec
from llmc.runtime.bench.benchmark import INTAKE_BURST
from llmc.runtime.cuda_graphs import DecodeGraphs
from llmc.runtime.decode_window import WindowState
from llmc.runtime.executor import Executor
from llmc.runtime.gc_heap import frozen_heap
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.responses import ExecutorParts
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.types import Request, SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "update")


class _SimPending:
    """A PendingStep whose ids are on the host only at ``end`` (simulated device time)."""

    def __init__(self, inner: Any, end: float) -> None:
        self._inner, self.end = inner, end

    def ready(self) -> bool:
        return time.perf_counter() >= self.end

    def result(self) -> Any:
        wait = self.end - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self._inner.result()


class SimulatedDevice:
    """A ModelRunner stand-in: the real runner's host work, plus simulated device time.

    A step launched at host time ``t`` starts when the previous step ends or at ``t``,
    whichever is later (one in-order stream), and runs ``prefill_s`` (a step with a chunk of
    more than one token) or ``decode_s``; its ids reach the host at its end. ``launch_s``
    (prefill, decode) adds host time to each launch (an eager prefill's kernel launches,
    a graph launch), spent while the simulated device already runs the step."""

    def __init__(
        self,
        runner: Any,
        prefill_s: float = 0.008,
        decode_s: float = 0.005,
        launch_s: tuple[float, float] = (0.0, 0.0),
        *,
        blocking_launch: bool = False,
    ) -> None:
        self.runner = runner
        self.blocking_launch = blocking_launch
        self.graphs = getattr(runner, "graphs", None)
        self.prefill_s, self.decode_s, self.launch_s = prefill_s, decode_s, launch_s
        self._free_at = 0.0
        self.launches: list[tuple[float, float]] = []  # (launch time, end) per step
        self.kinds: list[str] = []  # per step: "mixed" (prompt chunks) or "decode", " ahead"

    def launch(self, batch: Any, src_rows: list[int] | None = None) -> _SimPending:
        t0 = time.perf_counter()
        pending = self.runner.launch(batch, src_rows)
        # (a decode batch over slot rows: no objects to read; the runner made none either)
        prefill = batch.rows is None and any(s.num_new_tokens > 1 for s in batch.sequences)
        self.kinds.append(("mixed" if prefill else "decode") + (" ahead" if src_rows else ""))
        host = self.launch_s[0] if prefill else self.launch_s[1]
        if host > 0:
            time.sleep(host)
        start = max(t0, self._free_at)
        steps = batch.window.num_steps if batch.window is not None else 1  # multi-step
        gpu = self.prefill_s if prefill else self.decode_s * steps
        end = max(start + gpu, time.perf_counter())
        self._free_at = end
        self.launches.append((t0, end))
        if self.blocking_launch and end > time.perf_counter():
            time.sleep(end - time.perf_counter())
        return _SimPending(pending, end)

    def step(self, batch: Any) -> Any:
        return self.launch(batch).result()


def closed_loop_latency(
    ex: Executor,
    num_requests: int,
    isl: int,
    osl: int,
    concurrency: int = 1,
    vary_osl: bool = False,
    burst_intake: bool = True,
) -> tuple[list[float], list[float]]:
    """(TTFT, ITL) seconds per request of a closed loop in the caller's thread, as ``llmc
    bench --concurrency N`` drives it: a finished request is replaced before the next step,
    and more than ``INTAKE_BURST`` requests to send go in bursts with one step after each
    (``burst_intake``; False: all before the first step, as before 2026-12-07).
    ``vary_osl``: request ``i`` makes between osl/2 and 3·osl/2 tokens, so replacements
    arrive while the others decode (a multi-step window's arrival case)."""
    todo = list(range(num_requests))
    inflight: set[int] = set()
    first = len(ex.request_records)
    burst = INTAKE_BURST if burst_intake else num_requests
    params: dict[int, SamplingParams] = {}
    while todo or inflight:
        room = min(len(todo), concurrency - len(inflight))
        for _ in range(min(room, burst)):  # (a burst, then one step, as llmc bench does)
            i = todo.pop(0)
            n = osl // 2 + (i * 37) % max(1, osl) if vary_osl else osl
            sp = params.get(n)  # (one per output length, shared, as llmc bench does)
            if sp is None:
                sp = params[n] = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            ids = [(i * 7919 + j * 104729) % 128000 + 1 for j in range(isl)]
            inflight.add(ex.enqueue_request(Request(prompt_token_ids=ids, sampling=sp)))
        for r in ex.await_responses(list(inflight), max_steps=1 if room > burst else None):
            if r.is_final:
                inflight.discard(r.request_id)
    recs = ex.request_records[first:]
    ttft = [r.first_token_time - r.arrival_time for r in recs]
    itl = [(r.token_times[-1] - r.token_times[0]) / max(1, len(r.token_times) - 1) for r in recs]
    return ttft, itl


class NoopBackend:
    """Backend whose ops return their output buffers untouched; ``sample`` returns id 7."""

    name = "noop"

    def __init__(self, max_rows: int) -> None:
        self._ids = torch.full((max_rows,), 7, dtype=torch.int64)

    def embedding(self, ids, table, out=None):
        return out

    def rms_norm(self, x, weight, eps, out=None):
        return out

    def add_rms_norm(self, x, residual, weight, eps, out=None):
        return out, residual

    def linear(self, x, weight, bias=None, out=None):
        return out

    def rope_and_cache_write(self, qkv, positions, cos, sin, k_cache, v_cache, slots, out=None):
        return out

    def attention(self, q, k_cache, v_cache, meta, out=None):
        return out

    def silu_and_mul(self, x, out=None):
        return out

    def sample(self, logits, meta):
        return self._ids[: logits.shape[0]]


class _NoopGraph:
    def replay(self) -> None:
        pass


class MockGraphs(DecodeGraphs):
    """DecodeGraphs on CPU whose 'graphs' replay nothing (host work of the graph path). With
    a multi-step window, its token-feedback graphs replay nothing either: every window
    token reads as the no-op sampler's id 7."""

    def capture(self) -> None:
        for big in sorted(self.buckets, reverse=True):
            self._stage(big, None, [])  # records the bucket's staging layout
            self.graphs[big] = _NoopGraph()
            if self.window is not None:
                self.advance_graphs[big] = _NoopGraph()
        if self.window is not None:
            self.window.out.fill_(7)


def build(args: argparse.Namespace, wrap: Any = None) -> Executor:
    """The Executor of the measurement; ``wrap(runner)`` (e.g. a SimulatedDevice) replaces
    the runner it drives."""
    spec = ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=8192,
    )
    shapes = spec.tensor_shapes()
    weights = {n: torch.zeros(s) for n, s in shapes.items()}
    tpb, max_seq = 32, 4096
    num_blocks = args.batch * (-(-(args.isl + args.osl) // tpb)) + 8
    limits = EngineLimits(
        max_batch_size=args.batch,
        max_input_len=2048,
        max_seq_len=max_seq,
        max_num_tokens=8192,
        tokens_per_block=tpb,
        enable_chunked_prefill=True,
        dtype="float32",
    )
    runner = ModelRunner(
        spec,
        weights,
        backend=NoopBackend(args.batch),
        device="cpu",
        limits=limits,
        num_kv_blocks=num_blocks,
    )
    steps = getattr(args, "decode_steps_per_iteration", 1)
    if args.path == "graph":
        if steps > 1:
            runner.window = WindowState(limits, runner.device, steps)
        graphs = MockGraphs(
            runner.inputs, runner.forward, runner.backend, allow_cpu=True, window=runner.window
        )
        graphs.capture()
        runner.graphs = graphs
    kv = KVCacheManager(num_blocks, tpb, enable_block_reuse=True)
    sched = Scheduler(SchedulerConfig(limits, eos_token_ids=(128001,)), kv)
    drive = wrap(runner) if wrap is not None else runner
    return Executor(
        ExecutorParts(drive, sched, spec.vocab_size),
        async_scheduling=args.async_scheduling,
        decode_steps_per_iteration=steps,
    )


def run(args: argparse.Namespace) -> dict[str, float]:
    ex = build(args)
    sp = SamplingParams(max_new_tokens=args.osl, temperature=args.temperature, top_k=args.top_k)
    for i in range(args.batch):
        ids = [(i * 7919 + j * 104729) % 128000 + 1 for j in range(args.isl)]
        ex.enqueue_request(Request(prompt_token_ids=ids, sampling=sp, streaming=args.streaming))
    t0 = time.perf_counter()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    while ex.step():
        ex.await_responses(timeout=0)  # drain responses as a client would
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    decode = [r for r in ex.step_records if r.num_prefill_tokens == 0][args.warmup :]
    if getattr(args, "full_batch", False):  # only steps of the whole batch (no ramp-down)
        decode = [r for r in decode if r.batch_size == args.batch]
    if getattr(args, "decode_steps_per_iteration", 1) > 1:  # the full windows only
        decode = [r for r in decode if r.num_steps == args.decode_steps_per_iteration]
    stat = {"min": min, "mean": statistics.fmean}.get(
        getattr(args, "stat", "median"), statistics.median
    )
    # per decode step: a multi-step window's host time is shared by its K steps
    out = {p: stat(r.phase_times.get(p, 0.0) / r.num_steps for r in decode) * 1e6 for p in PHASES}
    steps = [(r.end_time - r.start_time) / r.num_steps for r in decode]
    out["step"] = stat(steps) * 1e6
    # host time per step as the loop runs it: from one step's end (its update) to the next
    # one's, per decode step (async scheduling: a step's record spans its schedule ahead,
    # in the previous ``Executor.step`` call, to its update, so ``step`` counts ~2 calls)
    index = {id(r): i for i, r in enumerate(ex.step_records)}
    kept = {index[id(r)] for r in decode}
    recs = ex.step_records
    gaps = [(recs[i].end_time - recs[i - 1].end_time) / recs[i].num_steps
            for i in sorted(kept) if i - 1 in kept]  # fmt: skip
    out["iter"] = stat(gaps) * 1e6 if gaps else float("nan")
    out["decode_steps"] = sum(r.num_steps for r in decode)
    out["wall_s"] = wall
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return out


def simulated(args: argparse.Namespace, async_scheduling: bool) -> Executor:
    """The Executor of the measurement over a SimulatedDevice of ``args``' step times."""
    args.async_scheduling = async_scheduling

    def wrap(r: Any) -> SimulatedDevice:
        return SimulatedDevice(
            r,
            args.prefill_ms / 1e3,
            args.decode_ms / 1e3,
            (args.launch_ms[0] / 1e3, args.launch_ms[1] / 1e3),
            blocking_launch=args.blocking_launch,
        )

    return build(args, wrap)


def latency(args: argparse.Namespace) -> None:
    """TTFT / ITL (ms, median) of a closed loop on a SimulatedDevice, async off and on."""
    for asy in (False, True):
        ex = simulated(args, asy)
        ttft, itl = closed_loop_latency(
            ex, args.requests, args.isl, args.osl, args.concurrency, args.vary_osl
        )
        print(
            f"async {asy!s:5}, K {getattr(args, 'decode_steps_per_iteration', 1)}: "
            f"TTFT p50 {statistics.median(ttft) * 1e3:.2f} ms "
            f"(max {max(ttft) * 1e3:.2f}), ITL p50 {statistics.median(itl) * 1e3:.2f} ms, "
            f"ahead steps {ex.num_ahead_steps}"
        )


class _GcPauses:
    """A ``gc.callbacks`` entry: the collections of each generation and their time."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0

    def ms(self) -> list[float]:
        return [round(s * 1e3, 1) for s in self.seconds]


def throughput(args: argparse.Namespace) -> None:
    """``--throughput``: the offline run of ``--requests`` requests (all queued at once) on a
    SimulatedDevice, async scheduling off and on: its wall time, output tok/s, the simulated
    device's busy share and its idle gaps by the kinds of the steps around them."""
    for asy in (False, True):
        ex = simulated(args, asy)
        pauses = _GcPauses()
        gc.callbacks.append(pauses)
        t0 = time.perf_counter()
        # the heap frozen around the run as ``llmc bench`` does (llmc.runtime.gc_heap)
        with contextlib.nullcontext() if args.no_freeze else frozen_heap():
            closed_loop_latency(
                ex,
                args.requests,
                args.isl,
                args.osl,
                args.requests,
                args.vary_osl,
                burst_intake=not args.all_at_once,
            )
        wall = time.perf_counter() - t0
        gc.callbacks.remove(pauses)
        d = ex.runner
        busy, gaps, free = 0.0, {}, 0.0  # the device's busy time; idle gaps by step kinds
        for i, (t, end) in enumerate(d.launches):
            start = max(t, free)
            busy += end - start
            if i and start > free:
                key = f"{d.kinds[i - 1]} -> {d.kinds[i]}"
                gaps.setdefault(key, []).append(start - free)
            free = end
        print(
            f"async {asy!s:5}: {wall:.3f} s, {args.requests * args.osl / wall:,.0f} output "
            f"tok/s, {len(d.launches)} steps ({d.kinds.count('mixed')} mixed), device busy "
            f"{busy / wall:.1%}; idle before the first step {d.launches[0][0] - t0:.3f} s "
            f"(the requests' intake), after the last {t0 + wall - free:.3f} s; garbage "
            f"collections by generation {pauses.count} taking {pauses.ms()} ms"
            + (" (heap not frozen)" if args.no_freeze else "")
        )
        for key, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1])):
            print(
                f"  idle before {key:24s} {len(v):4d} gaps, {sum(v):.3f} s, "
                f"mean {statistics.mean(v) * 1e3:.2f} ms"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--path", choices=("graph", "eager"), default="graph")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--async_scheduling", action="store_true")
    ap.add_argument(
        "--decode_steps_per_iteration",
        type=int,
        default=1,
        help="multi-step decoding: K decode steps per host iteration (default 1)",
    )
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the run")
    ap.add_argument(
        "--stat",
        choices=("median", "min", "mean"),
        default="median",
        help="per-phase statistic over the decode steps (min: robust on a shared machine; "
        "mean: counts the steps where every row fills a block and hashes it)",
    )
    ap.add_argument("--full_batch", action="store_true", help="only steps of --batch rows")
    ap.add_argument("--latency", action="store_true", help="TTFT/ITL on a simulated device")
    ap.add_argument(
        "--throughput",
        action="store_true",
        help="the offline run of --requests on a simulated device: tok/s, device busy share, "
        "idle gaps by step kinds",
    )
    ap.add_argument(
        "--all_at_once",
        action="store_true",
        help="--throughput: queue every request before the first step (not in bursts)",
    )
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument(
        "--no_freeze",
        action="store_true",
        help="--throughput: leave the heap unfrozen (llmc bench freezes it for its run)",
    )
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prefill_ms", type=float, default=8.0)
    ap.add_argument("--decode_ms", type=float, default=5.0)
    ap.add_argument("--launch_ms", type=float, nargs=2, default=(0.0, 0.0))
    ap.add_argument("--blocking_launch", action="store_true")
    ap.add_argument(
        "--vary_osl", action="store_true", help="--latency: output lengths osl/2 .. 3·osl/2"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.latency:
        latency(args)
        return
    if args.throughput:
        throughput(args)
        return
    res = run(args)
    print(
        f"batch {args.batch}, isl {args.isl}, osl {args.osl}, path {args.path}, "
        f"async {args.async_scheduling}, K {args.decode_steps_per_iteration}: "
        f"{res['decode_steps']} decode steps, "
        f"wall {res['wall_s']:.2f} s"
    )
    print(
        "µs per decode step: " + "  ".join(f"{p} {res[p]:.0f}" for p in (*PHASES, "step", "iter"))
    )


if __name__ == "__main__":
    main()
