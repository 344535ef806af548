"""``llmc bench``: throughput and latency of an engine under a workload, with a peer.

Flags → ``BenchSettings`` + ``RuntimeConfig`` (precedence: command line > the profile's
``workload:`` section > defaults) → ``llmc.runtime.bench.driver.run_bench`` → Rich report on
stdout, logs on stderr (a progress bar only when stderr is a terminal), ``--json FILE`` for
the versioned result (``--json -``: the JSON on stdout instead of the report).
Exit code: BenchFailure (9) when the failed share exceeds --max_failure_rate (default 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.base.errors import BenchFailure, ConfigError, UsageError, did_you_mean
from llmc.cli.options import (
    PROFILE_OPTION,
    AsyncScheduling,
    CudaGraphs,
    err_console,
    handle_errors,
    merge_settings,
    option,
    out_console,
    print_json,
    profile_section,
)
from llmc.runtime.bench.driver import BenchSettings, parse_percentiles
from llmc.runtime.bench.workload import ArrivalSpec, SyntheticSpec
from llmc.runtime.engine_runtime import RuntimeConfig

WORKLOAD_KEYS = (
    "num_requests", "isl", "osl", "isl_stdev", "osl_stdev", "distribution", "dataset",
    "concurrency", "request_rate", "burstiness", "warmup", "seed", "percentiles",
)  # fmt: skip
BENCH_KEYS = ("peer", "peer_batch_size", "peer_cache", "max_failure_rate", "engine_dir")
RUNTIME_KEYS = tuple(RuntimeConfig.field_names())
BENCH_DEFAULTS: dict[str, Any] = {"num_requests": 100, "isl": 128, "osl": 128, "warmup": 2}

# ---- options shared with `llmc profile` ---------------------------------------------------
EngineDir = Annotated[str | None, option("engine_dir", "Engine directory to benchmark (required).")]
NumRequests = Annotated[
    int | None, option("num_requests", "Measured requests. Default: 100 (profile: 16).")
]
Isl = Annotated[int | None, option("isl", "Mean input length, tokens. Default: 128 (profile: 64).")]
Osl = Annotated[
    int | None,
    option("osl", "Output length, tokens (ignore_eos: exact). Default: 128 (profile: 32)."),
]
IslStdev = Annotated[
    float | None, option("isl_stdev", "Stdev of input lengths, tokens. Default: 0.")
]
OslStdev = Annotated[
    float | None, option("osl_stdev", "Stdev of output lengths, tokens. Default: 0.")
]
Distribution = Annotated[
    str | None, option("distribution", "Length distribution: normal or uniform. Default: normal.")
]
Dataset = Annotated[
    str | None,
    option(
        "dataset",
        "trtllm-bench JSONL (task_id, prompt|input_ids, output_tokens) "
        "instead of synthetic requests. Default: none.",
        metavar="FILE",
    ),
]
Concurrency = Annotated[
    int | None,
    option(
        "concurrency", "Closed loop: keep N requests in flight. Default: offline (all at once)."
    ),
]
RequestRate = Annotated[
    float | None,
    option("request_rate", "Open loop: R requests/s with gamma arrivals. Default: offline."),
]
Burstiness = Annotated[
    float | None,
    option("burstiness", "Gamma shape of arrivals (1 = Poisson, <1 burstier). Default: 1."),
]
Warmup = Annotated[
    int | None,
    option("warmup", "Warm-up requests run first and excluded. Default: 2 (profile: 1)."),
]
Seed = Annotated[int | None, option("seed", "Seed of token ids, lengths and arrivals. Default: 0.")]
Percentiles = Annotated[
    str | None,
    option("percentiles", "Latency percentiles to report. Default: 50,90,99.", metavar="LIST"),
]
Device = Annotated[str | None, option("device", "auto, cpu or cuda. Default: auto.")]
Backend = Annotated[str | None, option("backend", "auto, torch or cuda. Default: auto.")]
MaxBatchSize = Annotated[
    int | None,
    option(
        "max_batch_size",
        "Lower the engine's max_batch_size (requests per step). Default: the engine's.",
    ),
]
MaxNumTokens = Annotated[
    int | None,
    option("max_num_tokens", "Lower the engine's per-step token budget. Default: the engine's."),
]
KvFraction = Annotated[
    float | None,
    option("kv_cache_free_gpu_mem_fraction", "Share of free memory for the KV pool. Default: 0.9."),
]
MaxKvTokens = Annotated[
    int | None,
    option("max_kv_tokens", "Absolute KV pool size, tokens. Default: from the fraction."),
]
Policy = Annotated[
    str | None,
    option(
        "scheduler_policy", "guaranteed_no_evict or max_utilization. Default: guaranteed_no_evict."
    ),
]
BlockReuse = Annotated[
    bool | None,
    option(
        "enable_block_reuse",
        "Reuse KV blocks of shared prefixes (true/false). Default: true.",
        metavar="BOOL",
    ),
]


def collect(cli: dict[str, Any], profile: str | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """CLI > profile ``workload:`` section > defaults, with every key checked."""
    section = profile_section(profile, "workload")
    allowed = (*WORKLOAD_KEYS, *BENCH_KEYS, *RUNTIME_KEYS)
    for key in section:
        if str(key).replace("-", "_") not in allowed:
            raise UsageError(
                f"profile {profile}: workload section: unknown setting {key!r}"
                + did_you_mean(str(key), list(allowed))
            )
    return {**defaults, **merge_settings(cli, section)}


def make_settings(s: dict[str, Any], **extra: Any) -> tuple[str, BenchSettings, RuntimeConfig]:
    """(engine_dir, BenchSettings, RuntimeConfig) from merged settings."""
    engine_dir = s.get("engine_dir")
    if not engine_dir:
        raise UsageError("--engine_dir is required (an engine built with `llmc build`)")
    seed = int(s.get("seed", 0))
    synthetic = SyntheticSpec(
        num_requests=s["num_requests"],
        isl=s["isl"],
        osl=s["osl"],
        isl_stdev=float(s.get("isl_stdev", 0.0)),
        osl_stdev=float(s.get("osl_stdev", 0.0)),
        distribution=s.get("distribution", "normal"),
        seed=seed,
    )
    arrival = ArrivalSpec.from_flags(
        s.get("concurrency"), s.get("request_rate"), float(s.get("burstiness", 1.0)), seed
    )
    pcts = s.get("percentiles", "50,90,99")
    settings = BenchSettings(
        synthetic=synthetic,
        dataset=s.get("dataset"),
        arrival=arrival,
        warmup=int(s["warmup"]),
        percentiles=parse_percentiles(pcts if isinstance(pcts, str) else list(pcts)),
        peer=s.get("peer"),
        peer_batch_size=s.get("peer_batch_size"),
        peer_cache=s.get("peer_cache", "auto"),
        **extra,
    )
    runtime = RuntimeConfig(**{k: s[k] for k in RUNTIME_KEYS if s.get(k) is not None})
    return str(engine_dir), settings, runtime


@contextmanager
def progress_bar(total_hint: int) -> Iterator[Any]:
    """Progress callback: a Rich bar on a terminal (stderr), nothing otherwise."""
    console = err_console()
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[bold]bench", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        task = bar.add_task("requests", total=total_hint)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def check_failures(result: dict[str, Any], max_failure_rate: float) -> None:
    agg = result["aggregates"]
    n, failed = agg["num_requests"], agg["num_failed"]
    if n and failed / n > max_failure_rate:
        first = agg["failures"][0]
        raise BenchFailure(
            f"{failed} of {n} requests failed ({failed / n:.1%} > --max_failure_rate "
            f"{max_failure_rate:g}); first: request {first['request_id']}: {first['reason']}"
        )


def write_json(path: str, result: dict[str, Any]) -> None:
    if path == "-":
        print_json(result)
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=str))
    err_console().print(f"results written to {p}", markup=False)


def bench_command(
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
    peer: Annotated[
        str | None,
        option(
            "peer",
            "Also run the workload through a peer on the same device: "
            "hf (transformers generate). Default: none.",
        ),
    ] = None,
    peer_batch_size: Annotated[
        int | None,
        option(
            "peer_batch_size",
            "Static batch size of the peer. Default: the "
            "concurrency, else min(max_batch_size, requests).",
        ),
    ] = None,
    peer_cache: Annotated[
        str | None,
        option(
            "peer_cache",
            "Peer KV cache: auto (static on CUDA where it works), "
            "static or dynamic. Default: auto.",
        ),
    ] = None,
    json_file: Annotated[
        str | None,
        option(
            "json",
            "Write the result (versioned JSON) to FILE; '-' prints it on "
            "stdout instead of the report. Default: none.",
            metavar="FILE",
        ),
    ] = None,
    max_failure_rate: Annotated[
        float | None,
        option(
            "max_failure_rate",
            "Exit non-zero (9) when the failed share of requests exceeds this. Default: 0.",
        ),
    ] = None,
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
    profile: Annotated[str | None, PROFILE_OPTION] = None,
) -> None:
    """Benchmark an engine: throughput, latency percentiles, KV cache; optionally vs a peer."""
    from llmc.runtime.bench.driver import run_bench
    from llmc.runtime.bench.report import render_bench

    cli = {k: v for k, v in locals().items() if k not in ("profile", "json_file")}
    s = collect(cli, profile, BENCH_DEFAULTS)
    engine, settings, runtime = make_settings(s)
    mfr = float(s.get("max_failure_rate", 0.0))
    if not 0.0 <= mfr <= 1.0:
        raise ConfigError(f"max_failure_rate must be in [0, 1], got {mfr}")
    log = err_console()
    with progress_bar(settings.synthetic.num_requests) as bar:
        outcome = run_bench(
            engine, settings, runtime, log=lambda m: log.print(m, markup=False), progress=bar
        )
    result = outcome.result.to_dict()
    result["config"]["max_failure_rate"] = mfr
    if json_file:
        write_json(json_file, result)
    if json_file != "-":
        render_bench(result, out_console())
    check_failures(result, mfr)


def register(app: typer.Typer) -> None:
    app.command("bench")(handle_errors(bench_command))
