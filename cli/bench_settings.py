"""What ``llmc bench`` and ``llmc profile`` share: the workload flags, their merge with a
profile's ``workload:`` section into ``BenchSettings`` + ``RuntimeConfig``, loading the
engine through the front door (``llmc.LLM``), and writing the JSON result.

Precedence: command line > the profile's ``workload:`` section > the command's defaults;
every key of the section is checked (an unknown one is a UsageError with a suggestion).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from llmc.base.errors import UsageError, did_you_mean
from llmc.cli.options import (
    RUNTIME_KEYS,
    Flag,
    merge_settings,
    print_json,
    profile_section,
    runtime_config,
)
from llmc.runtime.bench.driver import BenchSettings, parse_percentiles
from llmc.runtime.bench.workload import ArrivalSpec, BenchSampling, SyntheticSpec
from llmc.runtime.engine_runtime import RuntimeConfig

if TYPE_CHECKING:
    from llmc.api import LLM

# fmt: off
WORKLOAD_FLAGS: tuple[Flag, ...] = (
    Flag("num_requests", int, "Measured requests. Default: 100 (profile: 16)."),
    Flag("isl", int, "Mean input length, tokens. Default: 128 (profile: 64)."),
    Flag("osl", int, "Output length, tokens (ignore_eos: exact). Default: 128 (profile: 32)."),
    Flag("isl_stdev", float, "Stdev of input lengths, tokens. Default: 0."),
    Flag("osl_stdev", float, "Stdev of output lengths, tokens. Default: 0."),
    Flag("distribution", str, "Length distribution: normal or uniform. Default: normal."),
    Flag("dataset", str, "trtllm-bench JSONL (task_id, prompt|input_ids, output_tokens) or "
         "ShareGPT JSON (a JSON array) instead of synthetic requests. Default: none.",
         metavar="FILE"),
    Flag("concurrency", int, "Closed loop: keep N requests in flight. Default: offline (all "
         "at once)."),
    Flag("request_rate", float, "Open loop: R requests/s with gamma arrivals. Default: offline."),
    Flag("burstiness", float, "Gamma shape of arrivals (1 = Poisson, <1 burstier). Default: 1."),
    Flag("warmup", int, "Warm-up requests run first and excluded. Default: 2 (profile: 1)."),
    Flag("seed", int, "Seed of token ids, lengths and arrivals. Default: 0."),
    Flag("percentiles", str, "Latency percentiles to report. Default: 50,90,99.", metavar="LIST"),
    Flag("temperature", float, "Sampling temperature of every request; 0 = greedy (the only "
         "mode of --peer and --url). Default: 0."),
    Flag("top_p", float, "Top-p of every request, in (0, 1]. Default: 1."),
    Flag("top_k", int, "Top-k of every request; 0 = off. Default: 0."),
    Flag("n", int, "Outputs per request, sampled at --temperature (sharing the prompt's KV "
         "blocks; every output's tokens count). Default: 1."),
    Flag("beam_width", int, "Beam search of this many beams per request (greedy; at most the "
         "engine's max_beam_width; the best beam counts). Default: 1 (off)."),
)
# fmt: on
"""The workload of one benchmark (``SyntheticSpec``, ``ArrivalSpec``, ``BenchSettings``)."""

WORKLOAD_KEYS = tuple(f.name for f in WORKLOAD_FLAGS)
BENCH_KEYS = (
    "peer",
    "peer_batch_size",
    "peer_cache",
    "max_failure_rate",
    "engine_dir",
    "url",
    "model",
    "tokenizer",
    "api_key",
    "client_workers",
)
"""Keys a ``workload:`` section may hold beside the workload and the runtime settings."""


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


class _WorkloadTypes:
    """The types of the workload settings (flags are typed by typer; a YAML profile's
    ``workload:`` section is checked against these before anything converts it)."""

    engine_dir: str | None
    dataset: str | None
    num_requests: int | None
    isl: int | None
    osl: int | None
    isl_stdev: float | None
    osl_stdev: float | None
    distribution: str | None
    seed: int | None
    warmup: int | None
    concurrency: int | None
    request_rate: float | None
    burstiness: float | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    peer: str | None
    peer_batch_size: int | None
    peer_cache: str | None
    url: str | None
    model: str | None
    tokenizer: str | None
    api_key: str | None
    client_workers: int | None
    n: int | None
    beam_width: int | None


def make_settings(
    s: dict[str, Any], need_engine: bool = True
) -> tuple[str | None, BenchSettings, RuntimeConfig]:
    """(engine_dir, BenchSettings, RuntimeConfig) from merged settings (``need_engine``:
    --engine_dir is required; a run against --url takes it only to read the vocabulary)."""
    from llmc.compiler.input_bounds import check_field_types

    check_field_types(_WorkloadTypes, s, "workload setting")
    engine_dir = s.get("engine_dir")
    if not engine_dir and need_engine:
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
        sampling=BenchSampling(
            temperature=s.get("temperature", 0.0),
            top_p=s.get("top_p", 1.0),
            top_k=s.get("top_k", 0),
            n=s.get("n") or 1,
            beam_width=s.get("beam_width") or 1,
        ),
    )
    return (str(engine_dir) if engine_dir else None), settings, runtime_config(s)


def open_llm(engine_dir: str, runtime: RuntimeConfig, log: Console) -> LLM:
    """Load the engine through the front door, saying so on the log console."""
    from llmc.api import LLM

    log.print(f"loading engine {engine_dir}", markup=False)
    return LLM(engine_dir=engine_dir, runtime_config=runtime)


def check_output_path(path: str | None, flag: str = "--json") -> None:
    """Refuse an output FILE (``--json``, ``--trace``, ``--plot``) that cannot be written,
    before any work is done (UsageError, exit 2, naming the flag), so a long run never ends
    in a lost result: a directory, a parent that is a file, or a place this user cannot
    write. Its folders are made as the write would make them; a file that was not there is
    not left behind. '-' (stdout) and None pass."""
    if path is None or path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {p}: is a directory")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        existed = p.exists()
        with p.open("a"):
            pass
        if not existed:
            p.unlink()
    except OSError as e:
        raise UsageError(f"{flag} {p}: cannot be written ({e.strerror or e})") from None


def write_json(path: str, result: dict[str, Any], log: Console) -> None:
    """The result as JSON to ``path`` ('-': stdout, which then holds nothing else); a
    write that fails (the place changed since ``check_output_path``) is a UsageError."""
    if path == "-":
        print_json(result)
        return
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=1, default=str))
    except OSError as e:
        raise UsageError(f"--json {p}: results not written ({e.strerror or e})") from None
    log.print(f"results written to {p}", markup=False)
