"""``llmc calibrate``: calibrated scales of an engine's fp8 KV cache, measured over a text
and stored in the engine (``llmc.runtime.kv_calibration``).

Flags → ``CalibrationSettings`` → ``calibrate_engine`` → a Rich table of the scales before
and after (``--json FILE``: the result; ``-`` prints it instead of the table). Exit codes: a
text file that cannot be used is a UsageError (2); an engine without an fp8 KV cache, a
dummy-weights engine (no weights file to store scales in) or a window / token count out of
range a ConfigError (3); an engine that does not load its own code (7).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

import typer
from rich.table import Table

from llmc.base.errors import ConfigError, UsageError
from llmc.cli.bench_settings import check_output_path, write_json
from llmc.cli.options import (
    ENGINE_DIR_FLAG,
    Flag,
    err_console,
    handle_errors,
    option,
    out_console,
    with_flags,
)

MAX_CALIB_TOKENS = 1 << 20
"""More tokens than a calibration needs (ModelOpt's default is 512 samples of 512)."""

# fmt: off
CALIBRATE_FLAGS: tuple[Flag, ...] = (
    Flag("text_file", str, "UTF-8 text to run through the engine (e.g. "
         "/usr/share/common-licenses/GPL-3). Required.", metavar="FILE"),
    Flag("num_tokens", int, "Tokens of the text to run, from its start. Default: 8192."),
    Flag("window", int, "Tokens per prompt (capped at the engine's max_input_len). "
         "Default: 512."),
    Flag("device", str, "auto, cpu or cuda. Default: auto."),
    Flag("backend", str, "auto, torch or cuda. Default: auto."),
    Flag("smooth_k", bool, "Smooth K (SageAttention): store each layer's mean post-RoPE k per "
         "KV head and channel, cache k - mean and scale that (attention is unchanged: "
         "softmax cancels the mean). Default: on.", switch=True),
)
# fmt: on


def _count(flags: dict[str, Any], name: str, default: int) -> int:
    value = flags.get(name)
    if value is None:
        return default
    if not 1 <= value <= MAX_CALIB_TOKENS:
        raise ConfigError(f"--{name} {value}: must be in [1, {MAX_CALIB_TOKENS}]")
    return int(value)


@with_flags((ENGINE_DIR_FLAG,), CALIBRATE_FLAGS)
def calibrate_command(
    json_file: Annotated[
        str | None,
        option(
            "json",
            "Write the result (JSON: per-layer k/v scales before and after, tokens, windows, "
            "seconds) to FILE; '-' prints it on stdout instead of the table. Default: none.",
            metavar="FILE",
        ),
    ] = None,
    **flags: Any,
) -> None:
    """Calibrate an fp8 KV cache: per-layer k/v scales = max |k - k_mean|, |v| over a text /
    448 and smooth K's per-channel k_mean, written into the engine (TensorRT-LLM / ModelOpt
    max calibration; SageAttention's smooth K)."""
    from llmc.runtime.bench.perplexity import read_text
    from llmc.runtime.kv_calibration import CalibrationSettings, calibrate_engine

    if not flags.get("engine_dir"):
        raise UsageError("--engine_dir is required (an engine built with --kv_cache_dtype fp8)")
    if not flags.get("text_file"):
        raise UsageError("--text_file is required (the text to calibrate on)")
    settings = CalibrationSettings(
        engine_dir=str(flags["engine_dir"]),
        text_file=str(flags["text_file"]),
        num_tokens=_count(flags, "num_tokens", 8192),
        window=_count(flags, "window", 512),
        backend=flags.get("backend") or "auto",
        device=flags.get("device") or "auto",
        smooth_k=flags.get("smooth_k") is not False,
    )
    text, _ = read_text(settings.text_file)  # a bad file fails before the engine loads
    check_output_path(json_file)
    err_console().print(f"calibrating {settings.engine_dir} on {settings.text_file}", markup=False)
    result = asdict(calibrate_engine(settings, text))
    if json_file:
        write_json(json_file, result, err_console())
    if json_file != "-":
        table = Table(title="llmc calibrate: fp8 KV scales", title_justify="left")
        for col in ("layer", "k_scale (was)", "k_scale", "v_scale (was)", "v_scale"):
            table.add_column(col, justify="right")
        pairs = zip(result["scales"], result["previous"], strict=True)
        for i, ((k, v), (k0, v0)) in enumerate(pairs):
            table.add_row(str(i), f"{k0:.4g}", f"{k:.4g}", f"{v0:.4g}", f"{v:.4g}")
        out_console().print(table)
        out_console().print(
            f"{result['tokens']:,} tokens in {result['windows']} windows, "
            f"{result['seconds']:.1f} s; scales"
            f"{' and k means (smooth K)' if result['smooth_k'] else ''} stored in "
            f"{result['engine_dir']}",
            markup=False,
        )


def register(app: typer.Typer) -> None:
    app.command("calibrate")(handle_errors(calibrate_command))
