"""``llmc eval``: the perplexity of an engine over a text, from its own prompt logprobs.

Flags → ``EvalSettings`` + ``RuntimeConfig`` (precedence: command line > the profile's
``eval:`` section > defaults) → ``llmc.LLM`` → ``llmc.runtime.bench.perplexity.evaluate``
→ a Rich table on stdout. ``--json FILE`` writes the result (``--json -``: the JSON on stdout
instead of the table). Exit codes: a text file that cannot be used (missing, not a regular
file, binary, not UTF-8, empty, fewer than 2 tokens) is a UsageError (2), a window, stride
or max_windows out of range a ConfigError (3) naming the engine's limit.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from llmc.base.errors import UsageError
from llmc.cli.bench_settings import check_output_path, open_llm, write_json
from llmc.cli.options import (
    ENGINE_DIR_FLAG,
    PROFILE_OPTION,
    RUNTIME_FLAGS,
    RUNTIME_KEYS,
    Flag,
    check_keys,
    err_console,
    handle_errors,
    merge_settings,
    option,
    out_console,
    profile_section,
    runtime_config,
    with_flags,
)

# fmt: off
EVAL_FLAGS: tuple[Flag, ...] = (
    Flag("text_file", str, "UTF-8 text file to score (e.g. /usr/share/common-licenses/GPL-3). "
         "Required.", metavar="FILE"),
    Flag("window", int, "Tokens per window (each window is one prompt; its first token is "
         "context only). Default: the engine's max_input_len (max_seq_len - 1 if smaller)."),
    Flag("stride", int, "Tokens between window starts, 1..window; a smaller stride gives every "
         "scored token more context (transformers' perplexity guide). Default: the window "
         "(non-overlapping)."),
    Flag("max_windows", int, "Score at most this many windows (the first ones). Default: all."),
)
# fmt: on
EVAL_KEYS = ("engine_dir", *(f.name for f in EVAL_FLAGS), *RUNTIME_KEYS)
"""Keys an ``eval:`` profile section may hold."""


class _EvalTypes:
    """The types of the eval settings (a profile's values are checked before use)."""

    engine_dir: str | None
    text_file: str | None
    window: int | None
    stride: int | None
    max_windows: int | None


def render_eval(result: dict[str, Any], console: Console) -> None:
    """The result as one Rich table."""
    table = Table(title="llmc eval: perplexity", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    rt = result["runtime"]
    rows = [
        ("engine", f"{result['engine_dir']} ({rt['dtype']}, {rt['device']}/{rt['backend']})"),
        ("text", f"{result['text_file']} ({result['text_bytes']:,} bytes)"),
        ("text tokens", f"{result['text_tokens']:,}"),
        ("window / stride", f"{result['window']} / {result['stride']} tokens"),
        ("windows", f"{result['windows']:,}"),
        ("tokens scored", f"{result['tokens_scored']:,}"),
        ("mean NLL", f"{result['nll_mean']:.4f} nats/token"),
        ("perplexity", f"{result['perplexity']:.4f}"),
        ("seconds", f"{result['seconds']:.2f} s"),
        ("scored tokens/s", f"{result['tokens_per_s'] or 0:,.0f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


@with_flags((ENGINE_DIR_FLAG,), EVAL_FLAGS, RUNTIME_FLAGS)
def eval_command(
    json_file: Annotated[
        str | None,
        option(
            "json",
            "Write the result (JSON: perplexity, mean and summed NLL, tokens scored, windows, "
            "seconds, runtime) to FILE; '-' prints it on stdout instead of the table. "
            "Default: none.",
            metavar="FILE",
        ),
    ] = None,
    profile: Annotated[str | None, PROFILE_OPTION] = None,
    **flags: Any,
) -> None:
    """Perplexity of an engine over a text: teacher-forced windows, the engine's own prompt
    logprobs."""
    from llmc.compiler.input_bounds import check_field_types
    from llmc.runtime.bench.perplexity import EvalSettings, evaluate, read_text

    section = profile_section(profile, "eval")
    check_keys(section, EVAL_KEYS, f"profile {profile}: eval section")
    s = merge_settings(flags, section)
    check_field_types(_EvalTypes, s, "eval setting")
    if not s.get("engine_dir"):
        raise UsageError("--engine_dir is required (an engine built with `llmc build`)")
    if not s.get("text_file"):
        raise UsageError("--text_file is required (the text to score)")
    settings = EvalSettings(
        text_file=str(s["text_file"]),
        window=s.get("window"),
        stride=s.get("stride"),
        max_windows=s.get("max_windows"),
    )
    runtime = runtime_config(s)
    text = read_text(settings.text_file)  # a bad file fails before the engine loads
    check_output_path(json_file)
    log = err_console()

    def say(message: str) -> None:
        log.print(message, markup=False)

    with open_llm(str(s["engine_dir"]), runtime, log) as llm:
        result = evaluate(llm, settings, log=say, text=text).to_dict()
    if json_file:
        write_json(json_file, result, log)
    if json_file != "-":
        render_eval(result, out_console())


def register(app: typer.Typer) -> None:
    app.command("eval")(handle_errors(eval_command))
