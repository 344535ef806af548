"""scripts/bench_h200.sh's row groups (ROWS=issue12 / issue14 / issue17): each expands to rows
the script has a branch for, other names pass through, and the expansion keeps their order.
Only the script's ``expand_rows`` function runs (bash, no GPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_h200.sh"
TEXT = SCRIPT.read_text()


def _expand(rows: str) -> list[str]:
    func = re.search(r"^expand_rows\(\) \{\n.*?^\}\n", TEXT, re.S | re.M)
    assert func, "bench_h200.sh has no expand_rows function"
    out = subprocess.run(
        ["bash", "-c", func.group(0) + 'expand_rows "$1"', "_", rows],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return out.stdout.split()


def _branches() -> set[str]:
    loop = TEXT[TEXT.index("for r in $ROWS; do") :]
    return set(re.findall(r"^    ([a-z0-9]+)\)", loop, re.M))


@pytest.mark.parametrize("group", ["issue12", "issue14", "issue17"])
def test_each_group_names_rows_the_script_runs(group: str) -> None:
    rows = _expand(group)
    assert rows and group not in rows
    assert set(rows) <= _branches(), set(rows) - _branches()
    assert "b1" in rows and "128" in rows  # the BF16 rows they are compared with


def test_other_names_pass_through_in_order() -> None:
    assert _expand("2048 issue14 b1nopdl") == ["2048", *_expand("issue14"), "b1nopdl"]
    assert _expand("") == []
