"""Rich rendering of bench results (the JSON dict of ``BenchResult.to_dict()``).

Renders from the saved dict, so a live run, a saved ``--json`` file and ``llmc compare``
all print the same way. Sections: engine and build config (the endpoint, for an HTTP run),
workload, throughput (each rate beside its measured ceiling), latency percentiles, KV cache
and scheduler (in-process runs), failures.
When the result holds a peer run, a peer column and an llmc ÷ peer column are added.

Invariants: a missing number prints as "n/a", never as 0; every string taken from a result
(a saved file may hold anything) is printed through ``cell_text`` (``llmc.base.text.printable``
and Rich markup escaped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmc.base.text import printable

NA = "n/a"


def cell_text(value: Any) -> str:
    """A string from a result, safe in a Rich cell: control characters and markup escaped."""
    return escape(printable(value))


def dig(d: Any, path: str) -> Any:
    """``dig(result, "aggregates.ttft.mean")``; None when any key is missing or None."""
    for key in path.split("."):
        if not isinstance(d, dict) or d.get(key) is None:
            return None
        d = d[key]
    return d


def fmt(value: Any, spec: str = ",.2f", scale: float = 1.0, suffix: str = "") -> str:
    if value is None:
        return NA
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if isinstance(value, int) and scale == 1.0:
            return f"{value:,}{suffix}"
        v = value * scale
        if spec == ",.2f" and v != 0 and abs(v) < 1:
            spec = ".3g"  # small numbers keep three significant digits
        return f"{v:{spec}}{suffix}"
    return printable(value)


def pct(value: float | None) -> str:
    return fmt(value, ".1%")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


@dataclass(frozen=True)
class Headline:
    label: str
    path: str
    """Path below the run (``aggregates.…``): the same for llmc, the peer and saved runs."""
    higher_is_better: bool
    scale: float = 1.0
    spec: str = ",.2f"


def headlines(percentiles: list[float] | None = None) -> list[Headline]:
    """The numbers compared between runs: throughputs and latency mean + tail percentile."""
    tail = f"p{max(percentiles):g}" if percentiles else "p99"
    out = [
        Headline("Request throughput (req/s)", "aggregates.request_throughput", True),
        Headline("Output tokens/s", "aggregates.output_tokens_per_s", True),
        Headline("Total tokens/s", "aggregates.total_tokens_per_s", True),
        Headline("Per-user tokens/s (mean)", "aggregates.per_user_tokens_per_s.mean", True),
    ]
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        out.append(Headline(f"{name} mean (ms)", f"aggregates.{key}.mean", False, 1e3))
        out.append(
            Headline(f"{name} {tail} (ms)", f"aggregates.{key}.percentiles.{tail}", False, 1e3)
        )
    return out


def ratio_table(
    title: str, a: dict[str, Any], b: dict[str, Any], a_name: str, b_name: str
) -> Table:
    """Headline numbers of two runs with a ÷ b, and which one is better."""
    t = Table(title=cell_text(title), title_justify="left")
    a_name, b_name = cell_text(a_name), cell_text(b_name)
    for col in ("Metric", a_name, b_name, f"{a_name} ÷ {b_name}", "better"):
        t.add_column(col, justify="left" if col in ("Metric", "better") else "right")
    pcts = dig(a, "aggregates.percentiles")
    for h in headlines(pcts):
        va, vb = dig(a, h.path), dig(b, h.path)
        r = ratio(va, vb)
        better = NA
        if r is not None and r != 1.0:
            better = a_name if (r > 1.0) == h.higher_is_better else b_name
        t.add_row(
            h.label,
            fmt(va, h.spec, h.scale),
            fmt(vb, h.spec, h.scale),
            fmt(r, ".2f", 1, "×"),
            better,
        )
    return t


# ---- sections ---------------------------------------------------------------------------


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    for k, v in rows:
        t.add_row(k, cell_text(v))
    return t


def endpoint_section(result: dict[str, Any]) -> Table:
    """What an HTTP run (``llmc bench --url``) measured: the endpoint, timed by the client."""
    ep = dig(result, "config.endpoint") or {}
    env = result.get("environment") or {}
    rows = [
        ("endpoint", f"{ep.get('url', NA)} (OpenAI completions, streamed)"),
        ("model", str(ep.get("model", NA))),
        ("timed by", f"the client, on {env.get('device_name', NA)}"),
        ("versions", f"llmc {env.get('llmc_version', NA)} ({env.get('git_commit', NA)})"),
    ]
    return _kv_table("Endpoint", rows)


def engine_section(result: dict[str, Any]) -> Table:
    if dig(result, "config.endpoint") is not None:
        return endpoint_section(result)
    e = dig(result, "config.engine") or {}
    rt = dig(result, "config.runtime") or {}
    env = result.get("environment") or {}
    params = e.get("num_parameters")
    kv_pool = (
        f"max_kv_tokens={rt['max_kv_tokens']:,}"
        if rt.get("max_kv_tokens")
        else f"kv_cache_free_gpu_mem_fraction={fmt(rt.get('kv_cache_free_gpu_mem_fraction'))}"
    )
    rows = [
        ("engine", str(dig(result, "config.engine_dir"))),
        (
            "model",
            f"{e.get('architecture', NA)}, {fmt(params / 1e6 if params else None, ',.1f')}M "
            f"params, {e.get('num_layers', NA)} layers, hidden {e.get('hidden_size', NA)}, "
            f"heads {e.get('num_heads', NA)}/{e.get('num_kv_heads', NA)}",
        ),
        (
            "weights",
            f"{fmt(e.get('weight_bytes'), ',.0f', 1 / 2**20)} MiB {e.get('dtype', NA)}, "
            f"quantization {e.get('quantization', NA)}",
        ),
        (
            "build",
            f"target {e.get('target', NA)}, max_seq_len {fmt(e.get('max_seq_len'))}, "
            f"max_input_len {fmt(e.get('max_input_len'))}, tokens_per_block "
            f"{fmt(e.get('tokens_per_block'))}",
        ),
        (
            "runtime",
            f"{rt.get('backend', NA)} backend on {env.get('device_name', NA)}; "
            f"max_batch_size {fmt(rt.get('max_batch_size'))}, max_num_tokens "
            f"{fmt(rt.get('max_num_tokens'))} (per-step budget)",
        ),
        (
            "KV pool",
            f"{kv_pool}, kv_cache_dtype {e.get('kv_cache_dtype', NA)} "
            f"({fmt(e.get('kv_bytes_per_token'))} bytes/token), policy "
            f"{rt.get('scheduler_policy', NA)}, block reuse "
            f"{fmt(rt.get('enable_block_reuse'))}",
        ),
        (
            "versions",
            f"llmc {env.get('llmc_version', NA)} ({env.get('git_commit', NA)}), "
            f"torch {env.get('torch_version', NA)}",
        ),
    ]
    return _kv_table("Engine and build config", rows)


def workload_section(result: dict[str, Any]) -> Table:
    w = dig(result, "config.workload") or {}
    arr = dig(result, "config.arrival") or {}
    if w.get("source") == "dataset":
        src = f"dataset {w.get('dataset')}"
    else:
        src = (
            f"synthetic, isl {w.get('isl')}±{fmt(w.get('isl_stdev'), 'g')} / osl "
            f"{w.get('osl')}±{fmt(w.get('osl_stdev'), 'g')} ({w.get('distribution')}), "
            f"seed {w.get('seed')}"
        )
    rows = [
        ("requests", f"{fmt(w.get('num_requests'))} measured + {fmt(w.get('warmup'))} warmup"),
        ("source", src),
        (
            "lengths",
            f"mean isl {fmt(w.get('mean_isl'), ',.1f')}, mean osl "
            f"{fmt(w.get('mean_osl'), ',.1f')} (ignore_eos: outputs are exact)",
        ),
        ("arrivals", str(arr.get("description", NA))),
    ]
    return _kv_table("Workload", rows)


def _peer_cols(t: Table, has_peer: bool) -> None:
    if has_peer:
        t.add_column("peer (hf)", justify="right")
        t.add_column("llmc ÷ peer", justify="right")


def _row(t: Table, label: str, result: dict, path: str, has_peer: bool, **f: Any) -> None:
    v = dig(result, path)
    cells = [label, fmt(v, **f)]
    if has_peer:
        pv = dig(result, "peer." + path)
        cells += [fmt(pv, **f), fmt(ratio(v, pv), ".2f", 1, "×")]
    t.add_row(*cells)


def throughput_section(result: dict[str, Any]) -> Table:
    has_peer = result.get("peer") is not None
    t = Table(title="Throughput", title_justify="left")
    t.add_column("Metric")
    t.add_column("llmc", justify="right")
    _peer_cols(t, has_peer)
    a = "aggregates."
    _row(t, "Requests/s", result, a + "request_throughput", has_peer)
    _row(t, "Output tokens/s", result, a + "output_tokens_per_s", has_peer)
    _row(t, "Total tokens/s", result, a + "total_tokens_per_s", has_peer)
    _row(t, "Per-user tokens/s (mean)", result, a + "per_user_tokens_per_s.mean", has_peer)
    _row(t, "Duration (s)", result, a + "duration_s", has_peer, spec=",.3f")
    done = [
        fmt(dig(r, "aggregates.num_completed")) + " / " + fmt(dig(r, "aggregates.num_failed"))
        for r in (result, result.get("peer") or {})
    ]
    t.add_row("Completed / failed", done[0], *([done[1], ""] if has_peer else []))
    ach = result.get("achieved") or {}
    ceil = result.get("ceilings") or {}
    src = ceil.get("source", "no ceilings measured")
    t.caption = cell_text(
        f"Weight reads: {fmt(ach.get('weight_read_gb_s'))} GB/s of "
        f"{fmt(ach.get('copy_bandwidth_gb_s'), ',.1f')} GB/s copy ceiling "
        f"({pct(ach.get('bandwidth_utilization'))}); compute: {fmt(ach.get('tflops'))} "
        f"TFLOP/s of {fmt(ach.get('matmul_tflops'), ',.2f')} {ceil.get('matmul_dtype', '')} "
        f"matmul ceiling (MFU {pct(ach.get('mfu'))}). Ceilings {src}."
    )
    return t


def latency_section(result: dict[str, Any]) -> Table:
    has_peer = result.get("peer") is not None
    pcts = dig(result, "aggregates.percentiles") or [50, 90, 99]
    t = Table(title="Latency (ms)", title_justify="left")
    cols = ["mean", "median"] + [f"p{p:g}" for p in pcts]
    t.add_column("Metric")
    for c in cols:
        t.add_column(c, justify="right")
    if has_peer:
        t.add_column("peer mean", justify="right")
        t.add_column("llmc ÷ peer (mean)", justify="right")
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        d = dig(result, f"aggregates.{key}") or {}
        vals = [d.get("mean"), d.get("median")] + [
            (d.get("percentiles") or {}).get(c) for c in cols[2:]
        ]
        cells = [name] + [fmt(v, ",.2f", 1e3) for v in vals]
        if has_peer:
            pv = dig(result, f"peer.aggregates.{key}.mean")
            cells += [fmt(pv, ",.2f", 1e3), fmt(ratio(d.get("mean"), pv), ".2f", 1, "×")]
        t.add_row(*cells)
    return t


def kv_section(result: dict[str, Any]) -> Table | None:
    if dig(result, "config.endpoint") is not None:
        return None  # the engine's steps are the server's; /metrics has its KV use
    a = result.get("aggregates") or {}
    rows = [
        (
            "KV capacity",
            f"{fmt(a.get('kv_capacity_tokens'))} tokens in {fmt(a.get('kv_blocks_total'))} blocks",
        ),
        (
            "KV utilization",
            f"peak {pct(a.get('kv_peak_utilization'))} "
            f"({fmt(a.get('kv_peak_blocks_used'))} blocks), "
            f"mean {pct(a.get('kv_mean_utilization'))}",
        ),
        ("Prefix reuse hit rate", pct(a.get("prefix_hit_rate"))),
        ("Preemptions", fmt(a.get("num_preemptions"))),
        (
            "Running batch",
            f"mean {fmt(a.get('mean_batch_size'), ',.1f')}, peak {fmt(a.get('peak_batch_size'))}",
        ),
        (
            "Tokens per step",
            f"mean {fmt(a.get('mean_tokens_per_step'), ',.1f')}, peak "
            f"{fmt(a.get('peak_tokens_per_step'))}",
        ),
        ("Steps", f"{fmt(a.get('num_steps'))} steps, busy {fmt(a.get('busy_time_s'), ',.3f')} s"),
    ]
    return _kv_table("KV cache and scheduler", rows)


def failures_section(result: dict[str, Any], limit: int = 10) -> Table | None:
    fails = dig(result, "aggregates.failures") or []
    if not fails:
        return None
    t = Table(title=f"Failed requests ({len(fails)})", title_justify="left", style="red")
    t.add_column("request")
    t.add_column("reason")
    for f in fails[:limit]:
        t.add_row(cell_text(f.get("request_id")), cell_text(f.get("reason")))
    if len(fails) > limit:
        t.add_row("…", f"{len(fails) - limit} more (see --json)")
    return t


BENCH_SECTIONS: tuple[Callable[[dict[str, Any]], Table | None], ...] = (
    engine_section,
    workload_section,
    throughput_section,
    latency_section,
    kv_section,
    failures_section,
)


def render_bench(result: dict[str, Any], console: Console) -> None:
    for section in BENCH_SECTIONS:
        table = section(result)
        if table is not None:
            console.print(table)
