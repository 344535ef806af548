"""The profile report: its data (``ProfileReport``) and the Rich tables of it.

``ProfileReport`` is what one profiling session found (runtime/bench/profiling.py): time per
phase, per op family (with achieved rates) and per op, the measured peak memory, GPU idle
time and the tuning recommendations. ``to_dict`` is the ``profile`` section of
``llmc profile --json`` and the body of ``llmc.Profiler.summary()``, so both have the same
keys (``PROFILE_KEYS``). ``render_profile`` prints it the one way ``llmc profile`` and
``Profiler.print`` both use, next to the bench sections of runtime/bench/report.py.

Invariant, as in report.py: a missing number prints as "n/a", never as 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from llmc.base.errors import UsageError
from llmc.runtime.bench.gpu_idle import GpuIdle
from llmc.runtime.bench.recommend import Recommendation
from llmc.runtime.bench.report import fmt, kv_section, latency_section, pct, throughput_section
from llmc.runtime.bench.timers import BreakdownRow
from llmc.runtime.records import StepRecord

SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class ProfileReport:
    """What a profiling session found; ``to_dict()`` is the JSON ``profile`` section."""

    op_source: str
    """Where op times come from: CUDA kernels, CPU op hooks, or why there are none."""
    phases: list[BreakdownRow]
    """Time per step phase (schedule, prepare, forward, sample, update, other)."""
    op_families: list[BreakdownRow]
    """Time per op / kernel family, with achieved TFLOP/s and GB/s."""
    ops: list[BreakdownRow]
    """Time per op or kernel name."""
    peak_memory: dict[str, Any]
    """Measured peak allocation: {kind, bytes}."""
    recommendations: list[Recommendation]
    gpu_idle: GpuIdle | None
    """GPU idle between kernels (CUDA kernel timing only)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "op_source": self.op_source,
            "phases": [dataclasses.asdict(r) for r in self.phases],
            "op_families": [dataclasses.asdict(r) for r in self.op_families],
            "ops": [dataclasses.asdict(r) for r in self.ops],
            "peak_memory": self.peak_memory,
            "recommendations": [r.to_dict() for r in self.recommendations],
            "gpu_idle": self.gpu_idle.to_dict() if self.gpu_idle is not None else None,
        }


PROFILE_KEYS = tuple(f.name for f in dataclasses.fields(ProfileReport))


def breakdown_table(title: str, rows: Sequence[BreakdownRow], limit: int = 25) -> Table:
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
    """KV utilization, running batch and tokens per step over the run, as terminal charts."""
    kv = [s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0 for s in steps]
    batch = [float(s.batch_size) for s in steps]
    tokens = [float(s.num_tokens) for s in steps]
    console.print(f"[bold]Over {len(steps)} steps[/bold] (each column: max of its steps)")
    console.print(f"  KV utilization  {spark(kv)}  peak {pct(max(kv, default=None))}")
    console.print(f"  running batch   {spark(batch)}  peak {fmt(int(max(batch, default=0)))}")
    console.print(f"  tokens / step   {spark(tokens)}  peak {fmt(int(max(tokens, default=0)))}")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; UsageError when matplotlib is not installed
    (``llmc profile --plot`` asks before the run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib); the "
            "terminal chart and --trace FILE show the same data"
        ) from None
    return plt


def write_plot(path: str, steps: Sequence[StepRecord]) -> None:
    """KV utilization and running batch over time as a PNG (needs matplotlib)."""
    plt = pyplot()
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


def memory_table(engine: dict[str, Any], aggregates: dict[str, Any], peak: dict[str, Any]) -> Table:
    """The memory plan (weights, workspace, KV pool) beside the measured peak."""
    kv_bytes = None
    if aggregates.get("kv_capacity_tokens") and engine.get("kv_bytes_per_token"):
        kv_bytes = aggregates["kv_capacity_tokens"] * engine["kv_bytes_per_token"]
    planned = [engine.get("weight_bytes"), engine.get("workspace_bytes"), kv_bytes]
    total = sum(planned) if all(v is not None for v in planned) else None
    t = Table(title="Memory: plan vs measured", title_justify="left")
    t.add_column("item")
    t.add_column("MiB", justify="right")
    mib = 1 / 2**20
    for name, v in zip(("weights", "workspace (max_num_tokens)", "KV pool"), planned, strict=True):
        t.add_row(name, fmt(v, ",.1f", mib))
    t.add_row("planned total", fmt(total, ",.1f", mib))
    t.add_row(f"measured peak: {peak.get('kind')}", fmt(peak.get("bytes"), ",.1f", mib))
    return t


def recommendations_table(recs: Sequence[Recommendation]) -> Table:
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


def gpu_idle_line(idle: GpuIdle) -> str:
    """One line: how long the GPU waited between kernels (host-bound when large)."""
    text = f"GPU idle between kernels: {pct(idle.idle_share)} of the run"
    if idle.decode_idle_share is not None:
        text += f", {pct(idle.decode_idle_share)} of the decode-only stretch"
    return text + (
        " (time the GPU waits for the host: scheduling, input preparation, launches; "
        "CUDA graphs and async scheduling keep it small)"
    )


def render_profile(
    console: Console,
    result: dict[str, Any],
    report: ProfileReport,
    steps: Sequence[StepRecord],
    engine: dict[str, Any],
    *,
    kernels: bool = False,
) -> None:
    """The profile tables: throughput and latency (of ``result``, a bench result or any dict
    with ``aggregates``), time per phase and per op family, GPU idle, the per-op table when
    ``kernels``, memory, KV cache, the charts over time and the recommendations."""
    console.print(throughput_section(result))
    console.print(latency_section(result))
    console.print(breakdown_table("Time per phase (summed over steps)", report.phases))
    title = f"Time per op family ({report.op_source})"
    fams = report.op_families
    console.print(breakdown_table(title, fams) if fams else f"[dim]{title}: no events[/dim]")
    if report.gpu_idle is not None:
        console.print(gpu_idle_line(report.gpu_idle))
    if kernels and report.ops:
        console.print(breakdown_table("Time per op / kernel", report.ops, limit=60))
    console.print(memory_table(engine, result.get("aggregates") or {}, report.peak_memory))
    console.print(kv_section(result))
    over_time(steps, console)
    if report.recommendations:
        console.print(recommendations_table(report.recommendations))
