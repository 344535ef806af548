"""``llmc compare A.json [B.json]``: ratio table of two saved bench results.

With two files: the headline numbers of both runs and A ÷ B. With one file that holds a
``--peer`` run: llmc ÷ peer from that one run. Missing numbers print "n/a".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from llmc.base.errors import UsageError
from llmc.cli.options import handle_errors, out_console

SCHEMA = "llmc.bench"


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a ``llmc bench --json`` file, refusing anything that is not one."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"result file {str(p)!r} does not exist") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"result file {str(p)!r} is not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise UsageError(
            f"result file {str(p)!r} is not an llmc bench result (no schema {SCHEMA!r}); "
            "write one with `llmc bench --json FILE`"
        )
    return d


def compare(a_path: str, b_path: str | None, console: Console) -> None:
    from llmc.runtime.bench.report import ratio_table

    a = load_result(a_path)
    if b_path is None:
        if a.get("peer") is None:
            raise UsageError(
                f"{a_path} holds no peer run; give a second result file or bench with --peer hf"
            )
        console.print(ratio_table(f"llmc vs peer ({a_path})", a, a["peer"], "llmc", "peer"))
        return
    b = load_result(b_path)
    a_name, b_name = Path(a_path).stem, Path(b_path).stem
    if a_name == b_name:
        a_name, b_name = "A", "B"
    console.print(ratio_table(f"{a_path} vs {b_path}", a, b, a_name, b_name))
    for name, r, p in ((a_name, a, a_path), (b_name, b, b_path)):
        w = (r.get("config") or {}).get("workload") or {}
        env = r.get("environment") or {}
        console.print(
            f"[dim]{name}: {p}: {w.get('num_requests', 'n/a')} requests, "
            f"{env.get('device_name', 'n/a')}, commit {env.get('git_commit', 'n/a')}[/dim]"
        )


def compare_command(
    a: str = typer.Argument(..., help="Saved result of `llmc bench --json FILE` (numerator)."),
    b: str | None = typer.Argument(
        None, help="Second saved result (denominator); omit to compare A with its peer run."
    ),
) -> None:
    """Ratio table of two saved bench results (A ÷ B), or of one run and its peer."""
    compare(a, b, out_console())


def register(app: typer.Typer) -> None:
    app.command("compare")(handle_errors(compare_command))
