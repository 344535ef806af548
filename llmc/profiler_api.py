"""``Profiler``: ``llmc profile``'s report for any stretch of Python code that uses an ``LLM``.

    profiler = Profiler()          # or Profiler(llm)
    profiler.start()
    llm.generate(...)              # anything: generate, generate_async, llm.executor
    profiler.stop()
    profiler.print()               # the Rich tables of `llmc profile`
    profiler.summary()             # the same numbers as a dict
    profiler.export_chrome_trace("trace.json")

Nothing is re-timed here: between ``start`` and ``stop`` the profiler reads the executor's
own StepRecords and RequestRecords (those of requests that arrived in the window) and, as
``llmc profile`` does, attaches op timing — wall-clock hooks on the backend's ops on CPU,
``torch.profiler`` CUDA kernels on a GPU. Aggregation, breakdowns, recommendations and
the trace are the runtime's functions (runtime/metrics.py, runtime/profiler.py,
runtime/recommend.py); the tables are ``llmc profile``'s and the bench report's.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmc.base.errors import ConfigError

if TYPE_CHECKING:
    from llmc.api import LLM


class Profiler:
    """Profile what one ``LLM`` does between ``start()`` and ``stop()``.

    ``llm``: the LLM to watch; None means the only LLM alive at ``start()`` (an error when
    there is none or several). ``ops``: also time backend ops / CUDA kernels (on by default;
    it adds a little overhead per op on CPU). Usable as a context manager.
    """

    def __init__(self, llm: LLM | None = None, *, ops: bool = True) -> None:
        self.llm = llm
        self.ops = ops
        self._t0: float | None = None
        self._t1: float | None = None
        self._step0 = 0
        self._steps: list[Any] = []
        self._requests: list[Any] = []
        self._op_timer: Any = None
        self._kernels: Any = None
        self._events: list[Any] = []
        self._source = "not measured (ops=False)"
        self._target: LLM | None = None

    # ---- recording -----------------------------------------------------------------------
    def _pick(self) -> LLM:
        if self.llm is not None:
            if self.llm.closed:
                raise ConfigError("Profiler: the LLM it was given has been shut down")
            return self.llm
        from llmc.api import live_llms

        live = live_llms()
        if len(live) != 1:
            raise ConfigError(
                f"Profiler() found {len(live)} running LLMs; create the LLM before start(), "
                "or pass it: Profiler(llm)"
            )
        return live[0]

    def start(self) -> Profiler:
        """Begin the window (and op timing). Starting again discards the previous window."""
        if self.running:
            raise ConfigError("Profiler.start(): already started; call stop() first")
        llm = self._pick()
        from llmc.runtime.bench.profiler import KernelProfiler, OpTimer

        self._target, self._steps, self._requests, self._events = llm, [], [], []
        rt = llm.runtime
        if self.ops and rt.device == "cuda":
            self._kernels = KernelProfiler().__enter__()
            self._source = "torch.profiler CUDA kernels"
        elif self.ops:
            self._op_timer = OpTimer().attach(rt.runner.backend)
            self._source = "wall-clock op hooks (CPU)"
        self._step0 = len(llm.executor.step_records)
        self._t0, self._t1 = time.perf_counter(), None
        return self

    @property
    def running(self) -> bool:
        return self._t0 is not None and self._t1 is None

    def stop(self) -> Profiler:
        """End the window: collect the steps, requests and op events recorded in it."""
        if not self.running:
            raise ConfigError("Profiler.stop(): not started; call start() first")
        assert self._target is not None and self._t0 is not None
        self._t1 = time.perf_counter()
        if self._op_timer is not None:
            self._op_timer.detach()
            self._events, self._op_timer = list(self._op_timer.events), None
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            self._events = list(self._kernels.events)
            if self._kernels.error:
                self._source = self._kernels.error
            self._kernels = None
        ex = self._target.executor
        self._steps = list(ex.step_records[self._step0 :])
        t0, t1 = self._t0, self._t1
        self._requests = [r for r in ex.request_records if t0 <= r.arrival_time <= t1]
        return self

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.running:
            self.stop()

    def _need_data(self, what: str) -> None:
        if self._t1 is None:
            raise ConfigError(f"Profiler.{what}(): nothing recorded; call start() and stop()")

    # ---- results -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The window's numbers: ``aggregates`` (throughput, TTFT/TPOT/ITL/E2E, KV and batch,
        as ``llmc bench``), ``phases``, ``op_families``, ``ops``, ``peak_memory``,
        ``recommendations`` and the limits in use (``runtime``)."""
        self._need_data("summary")
        from llmc.runtime.bench.metrics import aggregate
        from llmc.runtime.bench.profiler import op_breakdown, peak_memory, phase_breakdown
        from llmc.runtime.bench.recommend import recommend

        assert self._target is not None and self._t0 is not None and self._t1 is not None
        llm = self._target
        runtime = llm.summary() if not llm.closed else {"engine_dir": str(llm.engine_dir)}
        agg = aggregate(
            self._requests,
            self._steps,
            tokens_per_block=runtime.get("tokens_per_block"),
            window=(self._t0, self._t1),
        )
        recs = recommend(agg, self._tuning_inputs()) if not llm.closed else []
        return {
            "window_s": self._t1 - self._t0,
            "runtime": runtime,
            "aggregates": agg.to_dict(),
            "op_source": self._source,
            "phases": [dataclasses.asdict(r) for r in phase_breakdown(self._steps)],
            "op_families": [dataclasses.asdict(r) for r in op_breakdown(self._events, "family")],
            "ops": [dataclasses.asdict(r) for r in op_breakdown(self._events, "name")],
            "peak_memory": peak_memory(llm.runtime.device) if not llm.closed else None,
            "recommendations": [r.to_dict() for r in recs],
        }

    def _tuning_inputs(self) -> Any:
        from llmc.runtime.bench.recommend import TuningInputs

        assert self._target is not None
        rt, cfg = self._target.runtime, self._target.config
        plan = rt.engine.plan if rt.engine is not None else None
        reqs = self._requests
        return TuningInputs(
            limits=rt.limits,
            build_limits=rt.built_limits,
            max_kv_tokens=cfg.max_kv_tokens,
            kv_cache_free_gpu_mem_fraction=cfg.kv_cache_free_gpu_mem_fraction,
            max_request_tokens=max(
                (r.num_prompt_tokens + r.num_output_tokens for r in reqs), default=1
            ),
            max_prompt_tokens=max((r.num_prompt_tokens for r in reqs), default=1),
            max_in_flight=max(1, len(reqs)),
            kv_bytes_per_token=plan.kv_bytes_per_token if plan is not None else None,
            workspace_bytes=plan.workspace_bytes if plan is not None else None,
        )

    def print(self, console: Any = None) -> None:
        """Print the tables of ``llmc profile`` for the window (to stdout, or ``console``)."""
        from rich.console import Console

        from llmc.cli.profile_cmd import _breakdown_table, over_time, recommendations_table
        from llmc.runtime.bench.recommend import Recommendation
        from llmc.runtime.bench.report import kv_section, latency_section, throughput_section

        s = self.summary()
        con = console or Console()
        from llmc.runtime.bench.profiler import BreakdownRow

        rows = {k: [BreakdownRow(**r) for r in s[k]] for k in ("phases", "op_families")}
        con.print(throughput_section(s))
        con.print(latency_section(s))
        con.print(_breakdown_table("Time per phase (summed over steps)", rows["phases"]))
        title = f"Time per op family ({s['op_source']})"
        fams = rows["op_families"]
        con.print(_breakdown_table(title, fams) if fams else f"[dim]{title}: no events[/dim]")
        con.print(kv_section(s))
        over_time(self._steps, con)
        if s["recommendations"]:
            recs = [Recommendation(**r) for r in s["recommendations"]]
            con.print(recommendations_table(recs))

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the window as a Chrome/Perfetto trace (steps with nested ops, phases, KV
        utilization and running batch counters, GPU kernels); returns the path."""
        self._need_data("export_chrome_trace")
        from llmc.runtime.bench.profiler import chrome_trace, write_chrome_trace

        assert self._target is not None
        gpu = self._source.startswith("torch.profiler")
        meta = {"engine_dir": str(self._target.engine_dir), "op_source": self._source}
        trace = chrome_trace(
            self._steps, [] if gpu else self._events, self._events if gpu else [], meta
        )
        return write_chrome_trace(path, trace)
