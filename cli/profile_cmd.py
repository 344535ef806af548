"""``llmc profile``: where the time goes, how full the KV cache runs, and what to tune.

Runs a workload like ``llmc bench`` (same flags, smaller defaults; cli/bench_settings.py)
through ``llmc.LLM`` with the one profiler around its measured requests
(``llmc.runtime.bench.profiling.profile_bench``: the session ``llmc.Profiler`` uses too), and
prints the profile tables (runtime/bench/profile_report.py): throughput and latency, time per
phase, per op / kernel family with achieved rates, the memory plan against the measured
peak, KV utilization and running batch over the run (terminal chart; PNG with --plot when
matplotlib is installed), and the tuning recommendations with reasons.
``--trace FILE`` writes a Chrome/Perfetto trace of steps, phases and ops/kernels;
``--json FILE`` the bench result with a ``profile`` section (``-``: on stdout, alone).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from llmc.base.errors import UsageError
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
    err_console,
    handle_errors,
    option,
    out_console,
    with_flags,
)

PROFILE_DEFAULTS: dict[str, Any] = {"num_requests": 16, "isl": 64, "osl": 32, "warmup": 1}
FILE_HELP = {
    "trace": "Write a Chrome/Perfetto trace (JSON) of steps, phases and ops/kernels to FILE. "
    "Default: none.",
    "plot": "Write KV utilization and running batch over time as a PNG (needs matplotlib). "
    "Default: none.",
    "json": "Write the result (bench schema + 'profile' section) to FILE. Default: none.",
}


@with_flags((ENGINE_DIR_FLAG,), WORKLOAD_FLAGS, RUNTIME_FLAGS)
def profile_command(
    trace: Annotated[str | None, option("trace", FILE_HELP["trace"], metavar="FILE")] = None,
    plot: Annotated[str | None, option("plot", FILE_HELP["plot"], metavar="FILE")] = None,
    kernels: Annotated[
        bool,
        option(
            "kernels",
            "Also print the per-op/kernel table (and, on CUDA, run "
            "python -m llmc.cuda.bench). Default: off.",
        ),
    ] = False,
    json_file: Annotated[str | None, option("json", FILE_HELP["json"], metavar="FILE")] = None,
    profile: Annotated[str | None, PROFILE_OPTION] = None,
    **flags: Any,
) -> None:
    """Profile an engine: phase and op/kernel breakdown, KV use over time, tuning advice."""
    from llmc.runtime.bench.profile_report import pyplot, render_profile, write_plot
    from llmc.runtime.bench.profiling import profile_bench

    s = collect(flags, profile, PROFILE_DEFAULTS)
    for k in ("peer", "peer_batch_size", "peer_cache", "max_failure_rate"):
        if k in s:
            raise UsageError(f"{k} is a bench setting; llmc profile does not run a peer")
    engine, settings, runtime = make_settings(s)
    for flag, path in (("--json", json_file), ("--trace", trace), ("--plot", plot)):
        check_output_path(path, flag)  # before the run: a result is never lost to its file
    if plot:
        pyplot()
    log = err_console()
    with open_llm(engine, runtime, log) as llm:
        run = profile_bench(llm, settings, log=lambda m: log.print(m, markup=False))
        device = llm.runtime.device
    session, result = run.session, run.to_dict()
    if trace:
        p = session.write_trace(trace)
        log.print(
            f"trace written to {p} (open in ui.perfetto.dev or chrome://tracing)", markup=False
        )
    if plot:
        write_plot(plot, session.steps)
        log.print(f"plot written to {plot}", markup=False)
    if json_file:
        write_json(json_file, result, log)
        if json_file == "-":  # the JSON is all stdout holds
            return
    con = out_console()
    render_profile(
        con, result, run.report, session.steps, result["config"]["engine"], kernels=kernels
    )
    if kernels and device == "cuda":
        import subprocess
        import sys

        subprocess.run([sys.executable, "-m", "llmc.cuda.bench"], check=False)


def register(app: typer.Typer) -> None:
    app.command("profile")(handle_errors(profile_command))
