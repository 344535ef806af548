"""Command-line interface: the typer app (build, run, bench, profile). Thin layer over the API."""
