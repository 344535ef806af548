"""The one profiler behind ``llmc profile`` and ``llmc.Profiler``: a session over a served engine.

A ``ProfileSession`` watches one ``Served`` engine (``llmc.LLM``) between ``start()`` and
``stop()`` (or around a block: ``measuring()``):

- op timing is attached for the window: ``torch.profiler`` CUDA kernels on a GPU
  (``KernelProfiler``), wall-clock hooks on the backend's ops on CPU (``OpTimer``). A
  kernel profiler that cannot start (no CUPTI, profiler busy) leaves the run untimed and
  ``source`` says why;
- ``stop()`` takes the engine's StepRecords of the window and the RequestRecords of the
  requests that arrived in it, and, while the engine is alive, what the report needs from it
  (engine and runtime facts, the measured peak memory, the model's FLOPs per token).

``report(aggregates)`` turns the window into a ``ProfileReport`` (runtime/bench/
profile_report.py): phases, op families with achieved rates, ops, peak memory, GPU idle and
the tuning recommendations. ``summary()`` adds the window's aggregates (``Profiler.summary``);
``profile_bench`` is ``llmc profile``: one benchmark with a session around its measured part.

Nothing is re-timed here: steps and requests are the engine's own records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.base.errors import ConfigError
from llmc.compiler.limits import EngineLimits
from llmc.runtime.bench.benchmark import ProgressFn
from llmc.runtime.bench.driver import (
    BenchOutcome,
    BenchSettings,
    engine_config,
    run_bench,
    runtime_config,
)
from llmc.runtime.bench.gpu_idle import gpu_idle
from llmc.runtime.bench.metrics import Aggregates, aggregate, is_failed, request_flops
from llmc.runtime.bench.profile_report import ProfileReport
from llmc.runtime.bench.recommend import TuningInputs, recommend
from llmc.runtime.bench.served import Served
from llmc.runtime.bench.timers import (
    BreakdownRow,
    KernelProfiler,
    OpEvent,
    OpTimer,
    chrome_trace,
    op_breakdown,
    peak_memory,
    phase_breakdown,
    with_model_rates,
    write_chrome_trace,
)
from llmc.runtime.records import RequestRecord, StepRecord

NOT_TIMED = "not measured (ops=False)"


class ProfileSession:
    """One profiling window over ``llm``; ``ops=False`` reads the records only."""

    def __init__(self, llm: Served, *, ops: bool = True) -> None:
        self.llm = llm
        self.ops = ops
        self.source = NOT_TIMED
        """Where op times come from (or why there are none)."""
        self.window: tuple[float, float] | None = None
        """(start, stop) in perf_counter seconds, once stopped."""
        self.steps: list[StepRecord] = []
        self.requests: list[RequestRecord] = []
        self.events: list[OpEvent] = []
        """CPU op calls, or CUDA kernels when ``on_gpu``."""
        self.on_gpu = False
        self.engine: dict[str, Any] = {}
        """Model, build limits and memory plan (``config.engine`` of a bench result)."""
        self.runtime: dict[str, Any] = {}
        """Runtime settings and limits in use (``config.runtime`` of a bench result)."""
        self.peak_memory: dict[str, Any] = {}
        self.limits: EngineLimits | None = None
        """The run's limits, and the engine's own (``build_limits``), once stopped."""
        self.build_limits: EngineLimits | None = None
        self._flops = (0.0, 0.0)  # per token at position 0, and per earlier token attended
        self._t0: float | None = None
        self._step0 = 0
        self._timer: OpTimer | None = None
        self._kernels: KernelProfiler | None = None

    @property
    def running(self) -> bool:
        return self._t0 is not None and self.window is None

    def start(self) -> ProfileSession:
        """Attach op timing and begin the window."""
        assert self._t0 is None, "a ProfileSession records one window"
        rt = self.llm.runtime
        if self.ops and rt.device == "cuda":
            try:
                self._kernels = KernelProfiler().__enter__()
                self.source, self.on_gpu = "torch.profiler CUDA kernels", True
            except Exception as e:  # no CUPTI, profiler busy: run without kernel timing
                self.source = f"kernel timing unavailable: {e!r}"
        elif self.ops:
            self._timer = OpTimer().attach(rt.runner.backend)
            self.source = "wall-clock op hooks (CPU)"
        self._step0 = len(self.llm.step_records)
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> ProfileSession:
        """End the window: detach op timing, collect the window's records and op events."""
        assert self.running and self._t0 is not None
        t1 = time.perf_counter()
        if self._timer is not None:
            self._timer.detach()
            self.events, self._timer = list(self._timer.events), None
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            self.events = list(self._kernels.events)
            if self._kernels.error:
                self.source = self._kernels.error
            self._kernels = None
        t0 = self._t0
        self.window = (t0, t1)
        self.steps = list(self.llm.step_records[self._step0 :])
        self.requests = [r for r in self.llm.request_records if t0 <= r.arrival_time <= t1]
        rt = self.llm.runtime
        self.engine = engine_config(rt)
        self.runtime = runtime_config(self.llm)
        self.peak_memory = peak_memory(rt.device)
        self.limits, self.build_limits = rt.limits, rt.built_limits
        f0 = rt.spec.flops_per_token(0)
        self._flops = (f0, rt.spec.flops_per_token(1) - f0)
        return self

    @contextlib.contextmanager
    def measuring(self) -> Iterator[ProfileSession]:
        """The window around a block: ``start()`` before it, ``stop()`` after (also when
        the block fails, so no op hook stays attached)."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    # ---- results (after stop) ------------------------------------------------------------
    def aggregates(self) -> Aggregates:
        """The window's aggregates (throughput over the window, latencies, KV, batch)."""
        assert self.window is not None, "stop() first"
        tpb = self.runtime.get("tokens_per_block")
        return aggregate(self.requests, self.steps, tokens_per_block=tpb, window=self.window)

    def report(self, agg: Aggregates, *, max_in_flight: int | None = None) -> ProfileReport:
        """Breakdowns, peak memory, GPU idle and recommendations of the window. ``agg``: its
        aggregates (a bench run's, or ``aggregates()``); ``max_in_flight``: the most requests
        the workload could have in flight (None: every request of the window)."""
        assert self.limits is not None and self.build_limits is not None, "stop() first"
        idle = gpu_idle(self.events, self.steps) if self.on_gpu else None
        inputs = TuningInputs.from_run(
            self.limits, self.build_limits, self.engine, self.runtime, self.requests,
            max_in_flight=max_in_flight, idle=idle,
        )  # fmt: skip
        return ProfileReport(
            op_source=self.source,
            phases=phase_breakdown(self.steps),
            op_families=self._model_rates(op_breakdown(self.events, "family")),
            ops=op_breakdown(self.events, "name"),
            peak_memory=self.peak_memory,
            recommendations=recommend(agg, inputs),
            gpu_idle=idle,
        )

    def summary(self) -> dict[str, Any]:
        """``window_s``, ``runtime``, ``aggregates`` and the report's keys, as plain data."""
        assert self.window is not None, "stop() first"
        agg = self.aggregates()
        return {
            "window_s": self.window[1] - self.window[0],
            "runtime": self.runtime,
            "aggregates": agg.to_dict(),
            **self.report(agg).to_dict(),
        }

    def _model_rates(self, rows: list[BreakdownRow]) -> list[BreakdownRow]:
        """Matmul and attention rates from the model's FLOPs where events carry none."""
        f0, fc = self._flops
        done = [r for r in self.requests if not is_failed(r) and r.finish_time is not None]
        weights = self.engine.get("weight_bytes")
        return with_model_rates(
            rows,
            matmul_flops=sum(request_flops(r, f0, 0.0) for r in done),
            weight_bytes_read=weights * len(self.steps) if weights is not None else None,
            attention_flops=sum(request_flops(r, 0.0, fc) for r in done),
        )

    def trace(self) -> dict[str, Any]:
        """The window as a Chrome/Perfetto trace: steps with nested CPU ops, phases, KV and
        batch counters, GPU kernels on their own process."""
        meta = {"engine_dir": str(self.llm.engine_dir), "op_source": self.source}
        cpu, gpu = ([], self.events) if self.on_gpu else (self.events, [])
        return chrome_trace(self.steps, cpu, gpu, meta)

    def write_trace(self, path: str | Path) -> Path:
        return write_chrome_trace(path, self.trace())


@dataclass(frozen=True)
class ProfileRun:
    """``llmc profile``'s run: the bench outcome, the session and its report."""

    outcome: BenchOutcome
    session: ProfileSession
    report: ProfileReport

    def to_dict(self) -> dict[str, Any]:
        """The bench result with the ``profile`` section (``llmc profile --json``)."""
        return {**self.outcome.result.to_dict(), "profile": self.report.to_dict()}


def profile_bench(
    llm: Served,
    settings: BenchSettings,
    *,
    log: Callable[[str], None] = lambda m: None,
    progress: ProgressFn | None = None,
) -> ProfileRun:
    """Run one benchmark on ``llm`` with a profiling session around its measured requests,
    and report on it. A peer run is a bench setting: profiling refuses it."""
    if settings.peer is not None:
        raise ConfigError(f"peer {settings.peer!r}: profiling runs no peer (llmc bench does)")
    session = ProfileSession(llm)
    outcome = run_bench(llm, settings, log=log, progress=progress, measure=session.measuring())
    arr = settings.arrival
    in_flight = arr.concurrency if arr.mode == "concurrency" else None
    report = session.report(outcome.result.aggregates, max_in_flight=in_flight)
    return ProfileRun(outcome, session, report)
