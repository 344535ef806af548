"""Shared CLI machinery for every ``llmc`` subcommand: flags, YAML profiles, errors, output.

How a command uses it (see cli/build_cmd.py for a complete one)::

    ENGINE_DIR = option("engine_dir", "Engine directory to run. Default: none (required).")

    @handle_errors
    def bench(
        engine_dir: Annotated[str | None, ENGINE_DIR] = None,
        profile: Annotated[str | None, PROFILE_OPTION] = None,
        json_out: Annotated[bool, JSON_OPTION] = False,
    ) -> None:
        cli = {"engine_dir": engine_dir}
        settings = merge_settings(cli, profile_section(profile, "workload"))
        ...

Rules this module implements:

- ``option(name, help)``: a typer option spelled both ``--max_num_tokens`` and
  ``--max-num-tokens``. Options default to ``None`` ("not given") so that values merge with
  precedence **CLI > YAML profile > dataclass defaults** (``merge_settings``). Help texts
  state meaning, unit and default themselves.
- A flag several commands take is declared once, as data (``Flag``), in a table such as
  ``RUNTIME_FLAGS`` (run, bench, profile: the ``RuntimeConfig`` fields; ``runtime_config``
  builds the config from merged settings); ``@with_flags(*tables)`` gives a command those
  flags, which it receives in ``**flags``.
- Profiles (``--profile NAME|PATH``): YAML mappings from ``llmc.profiles`` (by name) or a
  path, with sections ``PROFILE_SECTIONS`` (``model``: an HF-style config for dummy weights,
  ``build``: build settings, ``workload``/``run``/``profile``/``eval``/``serve``: settings of
  those commands).
  A file that is not a mapping, or an unknown section, is a UsageError (exit 2) with a
  did-you-mean, and so is one that is not UTF-8, too large or expands past a bound through
  YAML aliases (``input_bounds.load_yaml``); each command checks the keys of its own
  section (``check_keys``, or a config dataclass's ``from_dict``).
- ``handle_errors``: an LlmcError becomes one red line on stderr and the class's exit code;
  anything else exits 1 with a one-line message (a traceback only with ``LLMC_DEBUG=1``).
- Output: ``--json`` prints plain JSON on stdout (``print_json``) and nothing else there;
  logs and progress always go to stderr (``err_console``), a command's logs through the same
  console as its progress bar (so they print above it); the Rich progress display is used
  only when stderr is a terminal, plain lines otherwise (``progress_reporter``).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from llmc.base.errors import LlmcError, UsageError, did_you_mean
from llmc.base.text import printable
from llmc.runtime.engine_runtime import RuntimeConfig

PROFILE_SECTIONS = ("description", "model", "build", "workload", "run", "profile", "eval", "serve")
"""Top-level keys a profile YAML may have; each command reads the section(s) it owns."""

F = TypeVar("F", bound=Callable[..., Any])


# ---- flags -----------------------------------------------------------------------------
def option(name: str, help: str, *, metavar: str | None = None, hidden: bool = False) -> Any:
    """A typer Option accepting ``--name_with_underscores`` and ``--name-with-dashes``.

    Use with ``Annotated[T | None, option(...)] = None`` so that "not given" is ``None``
    and a profile value can fill it in. ``help`` must state meaning, unit and default.
    """
    decls = [f"--{name}"]
    dashed = name.replace("_", "-")
    if dashed != name:
        decls.append(f"--{dashed}")
    return typer.Option(*decls, help=help, metavar=metavar, show_default=False, hidden=hidden)


PROFILE_OPTION = option(
    "profile",
    "YAML profile: a name from llmc's profiles/ (e.g. llama3-8b) or a path. Its values are "
    "used for flags not given on the command line. Default: none.",
    metavar="NAME|PATH",
)
JSON_OPTION = option(
    "json", "Print the result as JSON on stdout (logs stay on stderr). Default: off."
)


# ---- profiles --------------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """A parsed profile file: its path and its top-level sections."""

    path: Path
    sections: dict[str, Any]

    def section(self, name: str) -> dict[str, Any]:
        """One section as a mapping ({} when absent); a non-mapping section is a UsageError."""
        if name not in PROFILE_SECTIONS:
            raise ValueError(f"unknown profile section {name!r}")
        value = self.sections.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise UsageError(
                f"profile {self.path}: section {name!r} must be a mapping, "
                f"got {type(value).__name__}"
            )
        return dict(value)


def available_profiles() -> list[str]:
    from importlib.resources import files

    return sorted(
        p.name[: -len(".yaml")]
        for p in files("llmc.profiles").iterdir()
        if p.name.endswith(".yaml")
    )


def find_profile(name_or_path: str) -> Path:
    """A profile's file: an existing path, or ``NAME`` → llmc/profiles/NAME.yaml."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    from importlib.resources import files

    candidate = files("llmc.profiles") / f"{name_or_path}.yaml"
    if candidate.is_file():
        return Path(str(candidate))
    names = available_profiles()
    raise UsageError(
        f"profile {name_or_path!r} is neither a file nor a built-in profile"
        + did_you_mean(name_or_path, names)
        + f"; built-in profiles: {', '.join(names) or 'none'}"
    )


@functools.lru_cache(maxsize=16)
def _load_profile_cached(path: str, mtime: float) -> Profile:
    from llmc.compiler.input_bounds import load_yaml

    p = Path(path)
    data = load_yaml(p, f"profile {p}")  # bounded: size, UTF-8, alias expansion
    if not isinstance(data, dict):
        raise UsageError(
            f"profile {p}: the top level must be a mapping of sections "
            f"({', '.join(PROFILE_SECTIONS)}), got {type(data).__name__}"
        )
    for key in data:
        if key not in PROFILE_SECTIONS:
            raise UsageError(
                f"profile {p}: unknown section {key!r}"
                + did_you_mean(str(key), PROFILE_SECTIONS)
                + f"; allowed: {', '.join(PROFILE_SECTIONS)}"
            )
    return Profile(p, data)


def load_profile(name_or_path: str) -> Profile:
    """Parse and check a profile (cached per file and modification time)."""
    p = find_profile(name_or_path)
    return _load_profile_cached(str(p), p.stat().st_mtime)


def profile_section(name_or_path: str | None, section: str) -> dict[str, Any]:
    """One section of a profile, or {} when no profile is given."""
    return {} if name_or_path is None else load_profile(name_or_path).section(section)


def check_keys(
    settings: Mapping[str, Any], allowed: tuple[str, ...] | list[str], source: str
) -> None:
    """UsageError naming the first unknown key (dash spellings accepted), with a suggestion."""
    for key in settings:
        if str(key).replace("-", "_") not in allowed:
            raise UsageError(
                f"{source}: unknown setting {key!r}" + did_you_mean(str(key), list(allowed))
            )


def merge_settings(cli: Mapping[str, Any], profile: Mapping[str, Any]) -> dict[str, Any]:
    """CLI values that were given (not None) over profile values; keys normalised to '_'."""
    merged = {str(k).replace("-", "_"): v for k, v in profile.items()}
    merged.update({k: v for k, v in cli.items() if v is not None})
    return merged


# ---- errors ----------------------------------------------------------------------------
def err_console() -> Console:
    """Rich console on stderr (colour only on a terminal; long lines are not wrapped)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def out_console() -> Console:
    """Rich console on stdout; 120 columns when it is not a terminal (logs, pipes)."""
    probe = Console()
    return Console(highlight=False, width=None if probe.is_terminal else 120)


def fail(message: str, exit_code: int) -> typer.Exit:
    """Print ``error: message`` in red on stderr; return the Exit to raise."""
    err_console().print(f"[bold red]error:[/] {escape(printable(message))}")
    return typer.Exit(exit_code)


def handle_errors(fn: F) -> F:
    """Decorator for a command: LlmcError → one red line + its exit code; other → exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except LlmcError as e:
            if os.environ.get("LLMC_DEBUG") == "1":
                import traceback

                traceback.print_exc()
            raise fail(" ".join(str(e).split("\n")), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except Exception as e:
            if os.environ.get("LLMC_DEBUG") == "1":
                import traceback

                traceback.print_exc()
            hint = (
                "" if os.environ.get("LLMC_DEBUG") == "1" else " (LLMC_DEBUG=1 shows the traceback)"
            )
            raise fail(f"unexpected {type(e).__name__}: {e}{hint}", 1) from None

    return wrapper  # type: ignore[return-value]


# ---- output ----------------------------------------------------------------------------
def print_json(obj: Any) -> None:
    """The command's result as plain JSON on stdout (nothing else may go there)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


@contextmanager
def progress_reporter(title: str) -> Iterator[Callable[[Any], None]]:
    """A callback for phase events (objects with ``phase``, ``status`` 'start'|'done',
    ``detail`` and ``elapsed_s``): a Rich progress display when stderr is a terminal, one
    plain stderr line per event otherwise."""
    console = err_console()
    if not console.is_terminal:

        def plain(ev: Any) -> None:
            if ev.status == "start":
                detail = f": {ev.detail}" if ev.detail else ""
                console.print(f"{title} [{ev.phase}]{escape(detail)}", markup=False)
            else:
                console.print(f"{title} [{ev.phase}] done in {ev.elapsed_s:.2f} s", markup=False)

        yield plain
        return

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    tasks: dict[str, Any] = {}
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:

        def rich_cb(ev: Any) -> None:
            label = f"[bold]{title}[/] {ev.phase}"
            if ev.detail:
                label += f" [dim]{escape(ev.detail)}[/]"
            if ev.status == "start":
                tasks[ev.phase] = bar.add_task(label, total=1)
            elif ev.phase in tasks:
                bar.update(tasks[ev.phase], completed=1, description=label + " [green]✓[/]")

        yield rich_cb


def human_bytes(n: float | None) -> str:
    """1536 → '1.50 KiB' (binary units)."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


# ---- flags as data: declared once, shared by the commands that take them -----------------
@dataclass(frozen=True)
class Flag:
    """One command-line flag, declared once; every command that takes it uses this object.

    ``type`` is the value's type (the option accepts ``type | None``, None = not given);
    ``switch`` makes a bool a ``--name/--no_name`` pair (both spellings, as ``option``)."""

    name: str
    type: Any
    help: str
    metavar: str | None = None
    switch: bool = False

    def parameter(self) -> inspect.Parameter:
        """The flag as a keyword parameter of a typer command (default None)."""
        if self.switch:
            dashed = self.name.replace("_", "-")
            info = typer.Option(
                f"--{self.name}/--no_{self.name}",
                f"--{dashed}/--no-{dashed}",
                help=self.help,
                show_default=False,
            )
        else:
            info = option(self.name, self.help, metavar=self.metavar)
        annotation = Annotated[self.type | None, info]
        kind = inspect.Parameter.KEYWORD_ONLY
        return inspect.Parameter(self.name, kind, default=None, annotation=annotation)


def with_flags(*groups: Sequence[Flag]) -> Callable[[F], F]:
    """Decorator: the command takes these flags (in order, before its own parameters).

    Typer reads the command's signature, so the decorator writes one (``__signature__``)
    from the flags and the function's own parameters; the function receives the flags by
    name in its ``**flags``. A name given twice is a bug caught here."""

    def decorate(fn: F) -> F:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(fn, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        params = [f.parameter() for group in groups for f in group] + own
        names = [p.name for p in params]
        dup = sorted({n for n in names if names.count(n) > 1})
        assert not dup, f"{fn.__name__}: flags declared twice: {dup}"
        fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return fn

    return decorate


ENGINE_DIR_FLAG = Flag("engine_dir", str, "Engine directory (built by llmc build). Required.")

# fmt: off
RUNTIME_FLAGS: tuple[Flag, ...] = (
    Flag("device", str, "auto, cpu or cuda. Default: auto."),
    Flag("backend", str, "auto (CUDA kernels on a GPU when the engine has them), torch or "
         "cuda. Default: auto."),
    Flag("max_batch_size", int, "Lower the engine's max_batch_size (requests per step). "
         "Default: the engine's."),
    Flag("max_num_tokens", int, "Lower the engine's per-step token budget. Default: the engine's."),
    Flag("kv_cache_free_gpu_mem_fraction", float, "Share of free memory (after weights and "
         "workspace) for the KV pool. Default: 0.9."),
    Flag("max_kv_tokens", int, "Absolute KV pool size, tokens. Default: from the fraction."),
    Flag("enable_block_reuse", bool, "Reuse KV blocks of shared prompt prefixes. Default: on.",
         switch=True),
    Flag("scheduler_policy", str, "guaranteed_no_evict or max_utilization (preempt by "
         "recompute). Default: guaranteed_no_evict."),
    Flag("cuda_graphs", bool, "Replay CUDA graphs for decode-only steps (CUDA backend). "
         "Default: on.", switch=True),
    Flag("prefill_graph_max_tokens", int, "With CUDA graphs: a step holding only one "
         "request's last prompt chunk of up to this many tokens (and plain sampling) replays "
         "a captured graph of its token-count bucket (16, 32, ... tokens) instead of "
         "launching each kernel from Python: the time to first token of an idle engine. "
         "0 = off. Default: 512."),
    Flag("piecewise_graph_max_tokens", int, "With CUDA graphs: the other steps (prefill "
         "batches, mixed prefill + decode steps) of up to this many tokens run their layers "
         "as captured CUDA graphs of their token-count bucket (16 ... 512, then every 256) "
         "with each attention launched eagerly between them. 0 = off. Default: 0."),
    Flag("async_scheduling", bool, "On CUDA, schedule and launch step N+1 while step N runs "
         "on the GPU (sampled ids stay on the device). Default: on.", switch=True),
    Flag("decode_steps_per_iteration", int, "Multi-step decoding: decode steps (1 to 64) the "
         "device runs per host iteration, sampled tokens fed back on the device, when every "
         "running request decodes and none waits for a free slot; streaming then comes in "
         "bursts of up to this many tokens. A step holding a request with logprobs, "
         "penalties, min_tokens, n/best_of > 1, beam search or more than 16 stop ids (EOS "
         "included) runs one decode step per iteration. Default: 1."),
    Flag("tp_timeout_s", float, "Engines built with --tp_size > 1: seconds the ranks may take "
         "to start and each collective may wait for the other ranks; a rank that dies or "
         "hangs ends the run with an error naming it (exit 7). Default: 60."),
)
# fmt: on
"""The runtime flags of ``llmc run``, ``bench`` and ``profile`` (``RuntimeConfig`` fields)."""

RUNTIME_KEYS = RuntimeConfig.field_names()
"""Every RuntimeConfig setting: the flags above, plus those only a profile section sets."""


def runtime_config(settings: Mapping[str, Any]) -> RuntimeConfig:
    """The RuntimeConfig of merged settings (keys not given keep the dataclass defaults); a
    value of the wrong type (a list where a number belongs, NaN) is a ConfigError naming it."""
    from llmc.compiler.input_bounds import check_field_types

    given = {k: settings[k] for k in RUNTIME_KEYS if settings.get(k) is not None}
    check_field_types(RuntimeConfig, given, "runtime setting")
    return RuntimeConfig(**given)
