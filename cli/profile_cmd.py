"""``llmc profile``: where the time goes, how full the KV cache runs, and what to tune.

Runs a workload like ``llmc bench`` (same flags, smaller defaults) with op timing attached
(wall-clock hooks on CPU, torch.profiler CUDA kernels on GPU) and prints: time per phase
(schedule, prepare, forward, sample, update), time per op / kernel family with share and
achieved rate, the memory plan against the measured peak, KV utilization and running batch
over the run (terminal chart; PNG with --plot when matplotlib is installed), and the tuning
recommendations (max_num_tokens = per-step budget; KV pool; max_batch_size) with reasons.
``--trace FILE`` writes a Chrome/Perfetto trace of steps, phases and ops/kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from llmc.base.errors import UsageError
from llmc.cli.bench_cmd import (
    Backend,
    BlockReuse,
    Burstiness,
    Concurrency,
    Dataset,
    Device,
    Distribution,
    EngineDir,
    Isl,
    IslStdev,
    KvFraction,
    MaxBatchSize,
    MaxKvTokens,
    MaxNumTokens,
    NumRequests,
    Osl,
    OslStdev,
    Percentiles,
    Policy,
    RequestRate,
    Seed,
    Warmup,
    collect,
    make_settings,
    write_json,
)  # fmt: skip
from llmc.cli.options import (
    PROFILE_OPTION,
    AsyncScheduling,
    CudaGraphs,
    err_console,
    handle_errors,
    option,
    out_console,
)
from llmc.runtime.bench.gpu_idle import GpuIdle, gpu_idle
from llmc.runtime.bench.metrics import request_flops
from llmc.runtime.bench.profiler import (
    BreakdownRow,
    KernelProfiler,
    OpTimer,
    chrome_trace,
    op_breakdown,
    peak_memory,
    phase_breakdown,
    with_model_rates,
    write_chrome_trace,
)
from llmc.runtime.bench.recommend import TuningInputs, recommend
from llmc.runtime.bench.report import fmt, kv_section, pct, throughput_section
from llmc.runtime.records import StepRecord

PROFILE_DEFAULTS: dict[str, Any] = {"num_requests": 16, "isl": 64, "osl": 32, "warmup": 1}
SPARK = "▁▂▃▄▅▆▇█"


class _Timers:
    """Attaches the right op timer to a runtime for the measured run."""

    def __init__(self) -> None:
        self.ops: OpTimer | None = None
        self.kernels: KernelProfiler | None = None
        self.source = "none"

    @contextlib.contextmanager
    def around(self, rt: Any) -> Iterator[None]:
        if rt.device == "cuda":
            self.kernels = KernelProfiler()
            self.source = "torch.profiler CUDA kernels"
            try:
                self.kernels.__enter__()
            except Exception as e:  # no CUPTI, profiler busy: run without kernel timing
                self.kernels, self.source = None, f"kernel timing unavailable: {e!r}"
                yield
                return
            try:
                yield
            finally:
                self.kernels.__exit__(None, None, None)
            if self.kernels.error:
                self.source = self.kernels.error
            return
        self.ops = OpTimer().attach(rt.runner.backend)
        self.source = "wall-clock op hooks (CPU)"
        try:
            yield
        finally:
            self.ops.detach()

    def events(self) -> list[Any]:
        if self.kernels is not None:
            return list(self.kernels.events)
        return list(self.ops.events) if self.ops is not None else []


def _breakdown_table(title: str, rows: Sequence[BreakdownRow], limit: int = 25) -> Table:
    t = Table(title=title, title_justify="left")
    for c in ("name", "calls", "total ms", "share", "mean µs", "TFLOP/s", "GB/s"):
        t.add_column(c, justify="left" if c == "name" else "right")
    for r in rows[:limit]:
        t.add_row(
            r.name[:60], fmt(r.count), fmt(r.total_s, ",.2f", 1e3), pct(r.share),
            fmt(r.mean_s, ",.1f", 1e6), fmt(r.tflops, ".3g"), fmt(r.gb_s, ",.1f"),
        )  # fmt: skip
    return t


def spark(values: Sequence[float], width: int = 80) -> str:
    """A one-line chart of ``values`` (resampled to ``width`` columns, max per column)."""
    if not values:
        return "n/a"
    n = len(values)
    cols = [max(values[i * n // width : max((i + 1) * n // width, i * n // width + 1)])
            for i in range(min(width, n))]  # fmt: skip
    top = max(cols) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in cols)


def over_time(steps: Sequence[StepRecord], console: Console) -> None:
    kv = [s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0 for s in steps]
    batch = [float(s.batch_size) for s in steps]
    tokens = [float(s.num_tokens) for s in steps]
    console.print(f"[bold]Over {len(steps)} steps[/bold] (each column: max of its steps)")
    console.print(f"  KV utilization  {spark(kv)}  peak {pct(max(kv, default=None))}")
    console.print(f"  running batch   {spark(batch)}  peak {fmt(int(max(batch, default=0)))}")
    console.print(f"  tokens / step   {spark(tokens)}  peak {fmt(int(max(tokens, default=0)))}")


def write_plot(path: str, steps: Sequence[StepRecord]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib); the "
            "terminal chart and --trace FILE show the same data"
        ) from None
    t0 = steps[0].start_time if steps else 0.0
    x = [s.start_time - t0 for s in steps]
    fig, (a, b) = plt.subplots(2, 1, sharex=True, figsize=(9, 5))
    a.plot(x, [s.kv_blocks_used / max(1, s.kv_blocks_total) for s in steps])
    a.set_ylabel("KV utilization")
    b.plot(x, [s.batch_size for s in steps], label="running batch")
    b.plot(x, [s.num_tokens for s in steps], label="tokens / step")
    b.set_xlabel("seconds")
    b.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_table(result: dict[str, Any], peak: dict[str, Any]) -> Table:
    e = result["config"]["engine"]
    a = result["aggregates"]
    kv_bytes = None
    if a.get("kv_capacity_tokens") and e.get("kv_bytes_per_token"):
        kv_bytes = a["kv_capacity_tokens"] * e["kv_bytes_per_token"]
    planned = [e.get("weight_bytes"), e.get("workspace_bytes"), kv_bytes]
    total = sum(planned) if all(v is not None for v in planned) else None
    t = Table(title="Memory: plan vs measured", title_justify="left")
    t.add_column("item")
    t.add_column("MiB", justify="right")
    mib = 1 / 2**20
    for name, v in zip(("weights", "workspace (max_num_tokens)", "KV pool"), planned, strict=True):
        t.add_row(name, fmt(v, ",.1f", mib))
    t.add_row("planned total", fmt(total, ",.1f", mib))
    t.add_row(f"measured peak: {peak['kind']}", fmt(peak.get("bytes"), ",.1f", mib))
    return t


def recommendations_table(recs: Sequence[Any]) -> Table:
    t = Table(title="Recommendations for this workload", title_justify="left", show_lines=True)
    for c in ("setting", "current", "observed", "suggested", "why"):
        t.add_column(c, overflow="fold")
    for r in recs:
        t.add_row(
            f"{r.setting}\n[dim]{r.meaning}[/dim]", r.current, r.observed, r.suggested, r.reason
        )
    t.caption = (
        "max_num_tokens is the per-step token budget (TensorRT-LLM semantics), not the KV pool "
        "size some tuning guides call it; the KV pool is max_kv_tokens or "
        "kv_cache_free_gpu_mem_fraction."
    )
    return t


def _model_rates(rows: list[BreakdownRow], outcome: Any) -> list[BreakdownRow]:
    rt, run = outcome.runtime, outcome.run
    f0 = rt.spec.flops_per_token(0)
    fc = rt.spec.flops_per_token(1) - f0
    done = [r for r in run.requests if r.error is None and r.finish_time is not None]
    mm = sum(request_flops(r, f0, 0.0) for r in done)
    attn = sum(request_flops(r, 0.0, fc) for r in done)
    wb = rt.engine.plan.weight_bytes_total * len(run.steps) if rt.engine is not None else None
    return with_model_rates(rows, matmul_flops=mm, weight_bytes_read=wb, attention_flops=attn)


def tuning_inputs(
    result: dict[str, Any], outcome: Any, idle: GpuIdle | None = None
) -> TuningInputs:
    e, rt = result["config"]["engine"], result["config"]["runtime"]
    w = result["config"]["workload"]
    arr = result["config"]["arrival"]
    reqs = outcome.run.requests
    in_flight = arr["concurrency"] if arr["mode"] == "concurrency" else len(reqs)
    longest = max((r.num_prompt_tokens + r.num_output_tokens for r in reqs), default=1)
    return TuningInputs(
        limits=outcome.runtime.limits, build_limits=outcome.runtime.built_limits,
        max_kv_tokens=rt.get("max_kv_tokens"),
        kv_cache_free_gpu_mem_fraction=rt.get("kv_cache_free_gpu_mem_fraction"),
        max_request_tokens=longest,
        max_prompt_tokens=w.get("max_isl") or 1, max_in_flight=max(1, int(in_flight or 1)),
        kv_bytes_per_token=e.get("kv_bytes_per_token"), workspace_bytes=e.get("workspace_bytes"),
        gpu_decode_idle_share=idle.decode_idle_share if idle is not None else None,
        cuda_graphs=rt.get("cuda_graphs"), async_scheduling=rt.get("async_scheduling"),
    )  # fmt: skip


def profile_command(
    engine_dir: EngineDir = None,
    num_requests: NumRequests = None,
    isl: Isl = None,
    osl: Osl = None,
    isl_stdev: IslStdev = None,
    osl_stdev: OslStdev = None,
    distribution: Distribution = None,
    dataset: Dataset = None,
    concurrency: Concurrency = None,
    request_rate: RequestRate = None,
    burstiness: Burstiness = None,
    warmup: Warmup = None,
    seed: Seed = None,
    percentiles: Percentiles = None,
    device: Device = None,
    backend: Backend = None,
    max_batch_size: MaxBatchSize = None,
    max_num_tokens: MaxNumTokens = None,
    kv_cache_free_gpu_mem_fraction: KvFraction = None,
    max_kv_tokens: MaxKvTokens = None,
    scheduler_policy: Policy = None,
    enable_block_reuse: BlockReuse = None,
    cuda_graphs: CudaGraphs = None,
    async_scheduling: AsyncScheduling = None,
    trace: Annotated[
        str | None,
        option(
            "trace",
            "Write a Chrome/Perfetto trace (JSON) of steps, phases "
            "and ops/kernels to FILE. Default: none.",
            metavar="FILE",
        ),
    ] = None,
    plot: Annotated[
        str | None,
        option(
            "plot",
            "Write KV utilization and running batch over time as a "
            "PNG (needs matplotlib). Default: none.",
            metavar="FILE",
        ),
    ] = None,
    kernels: Annotated[
        bool,
        option(
            "kernels",
            "Also print the per-op/kernel table (and, on CUDA, run "
            "python -m llmc.cuda.bench). Default: off.",
        ),
    ] = False,
    json_file: Annotated[
        str | None,
        option(
            "json",
            "Write the result (bench schema + 'profile' section) to FILE. Default: none.",
            metavar="FILE",
        ),
    ] = None,
    profile: Annotated[str | None, PROFILE_OPTION] = None,
) -> None:
    """Profile an engine: phase and op/kernel breakdown, KV use over time, tuning advice."""
    from llmc.runtime.bench.driver import run_bench

    skip = ("profile", "json_file", "trace", "plot", "kernels")
    cli = {k: v for k, v in locals().items() if k not in skip}
    s = collect(cli, profile, PROFILE_DEFAULTS)
    for k in ("peer", "peer_batch_size", "peer_cache", "max_failure_rate"):
        if k in s:
            raise UsageError(f"{k} is a bench setting; llmc profile does not run a peer")
    engine, settings, runtime = make_settings(s)
    log = err_console()
    timers = _Timers()
    outcome = run_bench(
        engine,
        settings,
        runtime,
        log=lambda m: log.print(m, markup=False),
        around_run=timers.around,
    )
    result = outcome.result.to_dict()
    steps = outcome.run.steps
    events = timers.events()
    ops, families = (
        op_breakdown(events, "name"),
        _model_rates(op_breakdown(events, "family"), outcome),
    )
    peak = peak_memory(outcome.runtime.device)
    idle = gpu_idle(events, steps) if timers.kernels is not None else None
    recs = recommend(outcome.result.aggregates, tuning_inputs(result, outcome, idle))
    result["profile"] = {
        "op_source": timers.source,
        "phases": [r.__dict__ for r in phase_breakdown(steps)],
        "op_families": [r.__dict__ for r in families],
        "ops": [r.__dict__ for r in ops],
        "peak_memory": peak,
        "recommendations": [r.to_dict() for r in recs],
        "gpu_idle": idle.to_dict() if idle is not None else None,
    }
    if trace:
        meta = {"engine_dir": engine, "op_source": timers.source}
        cpu_ops = events if timers.ops is not None else []
        gpu = events if timers.kernels is not None else []
        p = write_chrome_trace(trace, chrome_trace(steps, cpu_ops, gpu, meta))
        log.print(
            f"trace written to {p} (open in ui.perfetto.dev or chrome://tracing)", markup=False
        )
    if plot:
        write_plot(plot, steps)
        log.print(f"plot written to {plot}", markup=False)
    if json_file:
        write_json(json_file, result)
        if json_file == "-":  # the JSON is all stdout holds
            return
    con = out_console()
    con.print(throughput_section(result))
    con.print(_breakdown_table("Time per phase (summed over steps)", phase_breakdown(steps)))
    fam_title = f"Time per op family ({timers.source})"
    con.print(
        _breakdown_table(fam_title, families) if events else f"[dim]{fam_title}: no events[/dim]"
    )
    if idle is not None:
        con.print(gpu_idle_line(idle))
    if kernels and events:
        con.print(_breakdown_table("Time per op / kernel", ops, limit=60))
    con.print(memory_table(result, peak))
    con.print(kv_section(result))
    over_time(steps, con)
    con.print(recommendations_table(recs))
    if kernels and outcome.runtime.device == "cuda":
        _kernel_bench(log)


def gpu_idle_line(idle: GpuIdle) -> str:
    """One line: how long the GPU waited between kernels (host-bound when large)."""
    text = f"GPU idle between kernels: {pct(idle.idle_share)} of the run"
    if idle.decode_idle_share is not None:
        text += f", {pct(idle.decode_idle_share)} of the decode-only stretch"
    return text + (
        " (time the GPU waits for the host: scheduling, input preparation, launches; "
        "CUDA graphs and async scheduling keep it small)"
    )


def _kernel_bench(log: Console) -> None:
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("llmc.cuda.bench") is None:
        log.print("llmc.cuda.bench is not available; skipping the kernel micro-benchmarks")
        return
    subprocess.run([sys.executable, "-m", "llmc.cuda.bench"], check=False)


def register(app: typer.Typer) -> None:
    app.command("profile")(handle_errors(profile_command))
