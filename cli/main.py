"""The ``llmc`` typer app: every subcommand module registers itself; ``--version`` is here.

Importing this module (``llmc --version``, ``llmc --help``) must not import torch: the command
modules import the compiler and runtime lazily, inside their commands.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmc.base.version import ENGINE_FORMAT_VERSION, __version__
from llmc.cli import (
    bench_cmd,
    build_cmd,
    calibrate_cmd,
    compare_cmd,
    eval_cmd,
    import_cmd,
    profile_cmd,
    run_cmd,
    serve_cmd,
)

app = typer.Typer(
    name="llmc",
    help="Compile LLM checkpoints into engines, then run, serve, benchmark and profile them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def version_line() -> str:
    """What ``llmc --version`` prints: the release and the engine format it reads and writes."""
    return f"llmc {__version__} (engine format {ENGINE_FORMAT_VERSION})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            help="Print the llmc version and engine format version, then exit.",
            callback=_print_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    # The app's options only (its help text is the Typer's); commands run after this.
    del version


for _command in (
    build_cmd,
    import_cmd,
    run_cmd,
    bench_cmd,
    profile_cmd,
    eval_cmd,
    calibrate_cmd,
    compare_cmd,
    serve_cmd,
):
    _command.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
