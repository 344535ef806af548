"""``llmc bench``: throughput and latency of an engine under a workload, with a peer.

Flags → ``BenchSettings`` + ``RuntimeConfig`` (precedence: command line > the profile's
``workload:`` section > defaults; cli/bench_settings.py) → ``llmc.LLM`` →
``llmc.runtime.bench.driver.run_bench`` → Rich report on stdout. Logs and the progress bar
(only when stderr is a terminal) share one stderr console, so log lines print above the bar.
``--json FILE`` writes the versioned result (``--json -``: the JSON on stdout instead of the
report). With ``--url URL --model NAME`` no engine is loaded: the same workload goes to an
OpenAI-compatible server over streamed HTTP (``llmc.runtime.bench.http_driver``) and the
same aggregates are computed from the client's chunk arrival times. Exit code:
BenchFailure (9) when the failed share exceeds --max_failure_rate (default 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console

from llmc.base.errors import BenchFailure, ConfigError, UsageError
from llmc.cli.bench_settings import (
    WORKLOAD_FLAGS,
    check_output_path,
    collect,
    make_settings,
    open_llm,
    write_json,
)
from llmc.cli.options import (
    ENGINE_DIR_FLAG,
    PROFILE_OPTION,
    RUNTIME_FLAGS,
    Flag,
    err_console,
    handle_errors,
    option,
    out_console,
    with_flags,
)
from llmc.runtime.bench.benchmark import ProgressFn

BENCH_DEFAULTS: dict[str, Any] = {"num_requests": 100, "isl": 128, "osl": 128, "warmup": 2}

# fmt: off
PEER_FLAGS: tuple[Flag, ...] = (
    Flag("peer", str, "Also run the workload through a peer on the same device: hf "
         "(transformers generate). Default: none."),
    Flag("peer_batch_size", int, "Static batch size of the peer. Default: the concurrency, "
         "else min(max_batch_size, requests)."),
    Flag("peer_cache", str, "Peer KV cache: auto (static on CUDA where it works), static or "
         "dynamic. Default: auto."),
    Flag("max_failure_rate", float, "Exit non-zero (9) when the failed share of requests "
         "exceeds this. Default: 0."),
)
HTTP_FLAGS: tuple[Flag, ...] = (
    Flag("url", str, "Benchmark an OpenAI-compatible server instead of loading the engine: "
         "its base URL, e.g. http://127.0.0.1:8000/v1 (llmc serve, vLLM, TensorRT-LLM, ...). "
         "Default: none (in-process).", metavar="URL"),
    Flag("model", str, "With --url: the model name to request. Default: none (required)."),
    Flag("tokenizer", str, "With --url and no --engine_dir: a directory with tokenizer.json, "
         "for synthetic token ids and ShareGPT lengths. Default: none.", metavar="DIR"),
    Flag("api_key", str, "With --url: sent as Authorization: Bearer KEY. Default: "
         "$LLMC_API_KEY, else $OPENAI_API_KEY, else none."),
    Flag("client_workers", int, "With --url: client processes that send the requests "
         "(one Python process parses a few thousand stream chunks a second before it lags); "
         "0 = auto: one per 64 concurrent streams, at most a quarter of the CPU cores. "
         "Default: 0.", metavar="N"),
)
# fmt: on


@contextmanager
def progress_bar(console: Console, total_hint: int) -> Iterator[ProgressFn | None]:
    """Progress callback: a Rich bar on ``console`` when it is a terminal, else None. The
    bar draws on the console the logs print on, so a log line goes above the bar."""
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
        named = f"request {first['request_id']}: "
        reason = str(first["reason"]).removeprefix(named)  # (the engine's error names it)
        raise BenchFailure(
            f"{failed} of {n} requests failed ({failed / n:.1%} > --max_failure_rate "
            f"{max_failure_rate:g}); first: {named}{reason}"
        )


@with_flags((ENGINE_DIR_FLAG,), HTTP_FLAGS, WORKLOAD_FLAGS, PEER_FLAGS, RUNTIME_FLAGS)
def bench_command(
    json_file: Annotated[
        str | None,
        option(
            "json",
            "Write the result (versioned JSON) to FILE; '-' prints it on "
            "stdout instead of the report. Default: none.",
            metavar="FILE",
        ),
    ] = None,
    profile: Annotated[str | None, PROFILE_OPTION] = None,
    **flags: Any,
) -> None:
    """Benchmark an engine: throughput, latency percentiles, KV cache; optionally vs a peer."""
    from llmc.runtime.bench.driver import run_bench
    from llmc.runtime.bench.report import render_bench

    s = collect(flags, profile, BENCH_DEFAULTS)
    engine, settings, runtime = make_settings(s, need_engine=not s.get("url"))
    mfr = float(s.get("max_failure_rate", 0.0))
    if not 0.0 <= mfr <= 1.0:
        raise ConfigError(f"max_failure_rate must be in [0, 1], got {mfr}")
    check_output_path(json_file)
    log = err_console()
    say = lambda m: log.print(m, markup=False)  # noqa: E731
    if s.get("url"):
        with progress_bar(log, settings.synthetic.num_requests) as bar:
            result = _bench_url(s, engine, settings, say, bar).to_dict()
    else:
        assert engine is not None
        with (
            open_llm(engine, runtime, log) as llm,
            progress_bar(log, settings.synthetic.num_requests) as bar,
        ):
            result = run_bench(llm, settings, log=say, progress=bar).result.to_dict()
    result["config"]["max_failure_rate"] = mfr
    if json_file:
        write_json(json_file, result, log)
    if json_file != "-":
        render_bench(result, out_console())
    check_failures(result, mfr)


def _bench_url(
    s: dict[str, Any], engine: str | None, settings: Any, say: Any, bar: ProgressFn | None
) -> Any:
    """The benchmark against ``--url`` (no engine is loaded here)."""
    import os

    from llmc.runtime.bench.http_driver import Endpoint, client_model, run_bench_http

    if not s.get("model"):
        raise UsageError("--url needs --model NAME (the model the server serves)")
    if s.get("peer"):
        raise UsageError("--peer runs in-process only; leave it out with --url")
    key = s.get("api_key") or os.environ.get("LLMC_API_KEY") or os.environ.get("OPENAI_API_KEY")
    endpoint = Endpoint(s["url"], s["model"], key or None)
    workers = s.get("client_workers") or 0
    if workers < 0:
        raise UsageError(f"--client_workers must be >= 0 (0 = auto), got {workers}")
    model = client_model(engine, s.get("tokenizer"))
    return run_bench_http(endpoint, settings, model, log=say, progress=bar, workers=workers)


def register(app: typer.Typer) -> None:
    app.command("bench")(handle_errors(bench_command))
