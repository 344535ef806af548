"""``llmc serve``: an OpenAI-compatible HTTP server over one or more engines.

Flags → ``ServeConfig`` (engines, address, routing, queue, drain, key, body limit) and the
``RuntimeConfig`` every replica loads with (the runtime flags ``llmc run`` has, cli/options.py);
precedence CLI > the profile's ``serve:`` section > defaults. The key may come from
``LLMC_API_KEY`` instead of ``--api_key`` (which shows in the process list). Then
``llmc.serve.server.serve`` runs until SIGTERM (exit 0 after the drain) or a failure to load
an engine (that error's exit code). docs/SERVE.md has the endpoints and each setting.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from llmc.base.errors import UsageError
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
    profile_section,
    runtime_config,
    with_flags,
)

# fmt: off
SERVE_FLAGS: tuple[Flag, ...] = (
    ENGINE_DIR_FLAG,
    Flag("engine", list[str], "NAME=DIR: serve the engine DIR as model NAME (repeatable; a "
         "name given twice is two replicas). Default: --engine_dir, named after its folder.",
         metavar="NAME=DIR"),
    Flag("host", str, "Address to listen on. Default: 127.0.0.1."),
    Flag("port", int, "TCP port; 0 picks a free one (printed on stderr). Default: 8000."),
    Flag("routing", str, "How a model's replicas share requests: round_robin or "
         "least_loaded (fewest unfinished). Default: round_robin."),
    Flag("max_queue", int, "Requests a replica holds beyond its max_batch_size; more get 503 "
         "with Retry-After. Default: 1024."),
    Flag("drain_timeout", float, "Seconds in-flight requests get to finish after SIGTERM. "
         "Default: 30."),
    Flag("api_key", str, "Require Authorization: Bearer KEY on /v1/*. Default: "
         "$LLMC_API_KEY, else none."),
    Flag("max_body_bytes", int, "Largest request body, bytes (413 beyond). Default: 16 MiB."),
)
# fmt: on

SERVE_KEYS = tuple(f.name for f in SERVE_FLAGS) + RUNTIME_KEYS


@with_flags(SERVE_FLAGS, RUNTIME_FLAGS)
def serve_command(profile: Annotated[str | None, PROFILE_OPTION] = None, **flags: Any) -> None:
    """Serve engines over HTTP with the OpenAI API (completions, chat, models, metrics)."""
    from llmc.compiler.input_bounds import check_field_types
    from llmc.serve.config import EngineSpec, ServeConfig

    section = profile_section(profile, "serve")
    check_keys(section, SERVE_KEYS, f"profile {profile} (serve:)")
    cli = dict(flags)
    cli["engine"] = cli["engine"] or None
    s = merge_settings(cli, section)
    if s.get("api_key") is None and os.environ.get("LLMC_API_KEY"):
        s["api_key"] = os.environ["LLMC_API_KEY"]
    engines = [EngineSpec.parse(e) for e in _strings(s.get("engine"), "engine")]
    if s.get("engine_dir"):
        engines.insert(0, EngineSpec.from_dir(str(s["engine_dir"])))
    if not engines:
        raise UsageError("no engine: give --engine_dir DIR or --engine NAME=DIR (repeatable)")
    given = {k: s[k] for k in _ServeTypes.__annotations__ if s.get(k) is not None}
    check_field_types(_ServeTypes, given, "serve setting")
    config = ServeConfig(engines=tuple(engines), runtime=runtime_config(s), **given)

    from llmc.serve.server import serve

    log = err_console()
    code = serve(config, say=lambda m: log.print(m, markup=False))
    if code:
        raise typer.Exit(code)


class _ServeTypes:
    """The types of the serve settings a profile may set (flags are typed by typer)."""

    host: str
    port: int
    routing: str
    max_queue: int
    drain_timeout: float
    api_key: str
    max_body_bytes: int


def _strings(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise UsageError(f"{name}: expected NAME=DIR strings, got {value!r}")
    return items


def register(app: typer.Typer) -> None:
    app.command("serve")(handle_errors(serve_command))
