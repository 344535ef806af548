"""``llmc compare A.json [B.json]``: ratio table of two saved bench results.

With two files: the headline numbers of both runs and A ÷ B. With one file that holds a
``--peer`` run: llmc ÷ peer from that one run. Missing numbers print "n/a".

A file that is not a UTF-8 JSON bench result, or whose compared values have the wrong type
(a number stored as a string, a section that is not an object), is a UsageError (exit 2)
naming the file and the key; strings from the files are printed escaped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from llmc.base.errors import UsageError
from llmc.base.text import printable
from llmc.cli.options import handle_errors, out_console

SCHEMA = "llmc.bench"


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a ``llmc bench --json`` file, refusing anything that is not one."""
    p = Path(path)
    try:
        d = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UsageError(f"result file {str(p)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"result file {str(p)!r} is not UTF-8 text (byte {e.start})") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"result file {str(p)!r} is not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise UsageError(
            f"result file {str(p)!r} is not an llmc bench result (no schema {SCHEMA!r}); "
            "write one with `llmc bench --json FILE`"
        )
    _check_run(d, p, "")
    if d.get("peer") is not None:
        _check_run(d["peer"], p, "peer.")
    for key in ("config", "config.workload", "environment"):
        _check_type(d, key, dict, "an object", p)
    return d


def _check_type(
    d: dict[str, Any], path: str, want: Any, name: str, file: Path, prefix: str = ""
) -> None:
    """``d``'s value at dotted ``path`` is absent, null or of type ``want``; else UsageError."""
    from llmc.runtime.bench.report import dig

    head, _, key = path.rpartition(".")
    parent = dig(d, head) if head else d
    value = parent.get(key) if isinstance(parent, dict) else None
    ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
    if value is not None and not ok:
        raise UsageError(
            f"result file {str(file)!r}: {prefix}{printable(path)} must be {name}, got "
            f"{printable(repr(value))[:80]}"
        )


def _check_run(run: Any, file: Path, prefix: str) -> None:
    """The values ``ratio_table`` reads from one run have their types."""
    from llmc.runtime.bench.report import headlines

    if not isinstance(run, dict):
        raise UsageError(f"result file {str(file)!r}: {prefix or 'the run'} must be an object")
    if "aggregates" not in run:
        raise UsageError(f"result file {str(file)!r}: missing key {prefix + 'aggregates'!r}")
    _check_type(run, "aggregates", dict, "an object", file, prefix)
    pcts = (run.get("aggregates") or {}).get("percentiles")
    if pcts is not None and (
        not isinstance(pcts, list)
        or not pcts
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pcts)
    ):
        raise UsageError(
            f"result file {str(file)!r}: {prefix}aggregates.percentiles must be a non-empty "
            "list of numbers"
        )
    for h in headlines(pcts):
        for depth in range(1, h.path.count(".")):
            _check_type(run, h.path.rsplit(".", depth)[0], dict, "an object", file, prefix)
        _check_type(run, h.path, (int, float), "a number", file, prefix)


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
        line = (
            f"{name}: {p}: {w.get('num_requests', 'n/a')} requests, "
            f"{env.get('device_name', 'n/a')}, commit {env.get('git_commit', 'n/a')}"
        )
        console.print(printable(line), style="dim", markup=False)


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
