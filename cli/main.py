"""The ``llmc`` typer app. Each subcommand lives in its own module and registers itself."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="llmc",
    help="Compile LLM checkpoints into engines, then run, benchmark and profile them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _register() -> None:
    import importlib

    for mod in ("build_cmd", "import_cmd", "run_cmd", "bench_cmd", "profile_cmd", "compare_cmd"):
        try:
            module = importlib.import_module(f"llmc.cli.{mod}")
        except ModuleNotFoundError as e:  # a command not written yet
            if e.name == f"llmc.cli.{mod}":
                continue
            raise
        module.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
