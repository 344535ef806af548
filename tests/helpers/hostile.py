"""The hostile-input suite's harness: one case = one ``llmc`` command that must fail cleanly.

A ``Case`` names the command line (with ``{tmp}`` and fixture placeholders filled in by the
test), the exit code it must end with, and fragments its error line must contain. ``run_case``
runs it in a child process under a wall-clock limit and an address-space limit, so a case that
loops or allocates without bound fails the test instead of hanging or swapping the CI machine,
and checks the promises every bad input gets: the documented exit code, a message naming the
input, no traceback, nothing on stdout for a failed command (``--json`` output included).

The tests of tests/hostile/ are tables of cases (``pytest.mark.parametrize`` over ``Case``s).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY_MB = 4096
"""Address-space limit of one case (torch alone maps ~1.5 GB of virtual memory)."""


@dataclass(frozen=True)
class Case:
    """One hostile input: ``llmc ARGS`` must exit with ``exit_code`` and say ``says``."""

    name: str
    args: Sequence[str]
    exit_code: int
    says: Sequence[str] = ()
    """Fragments the error output must contain (e.g. the input's name, the limit)."""
    stdin: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:  # the parametrize id
        return self.name


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stdout: str
    stderr: str
    seconds: float


def _limit_memory(mb: int):
    def apply() -> None:
        limit = mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def run_llmc(
    args: Sequence[str],
    *,
    stdin: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    env: dict[str, str] | None = None,
) -> Outcome:
    """``python -m llmc.cli.main ARGS`` in a child process with bounded time and memory.
    A case that runs past ``timeout_s`` raises ``subprocess.TimeoutExpired`` (a failure)."""
    child_env = {k: v for k, v in os.environ.items() if k != "LLMC_DEBUG"}
    child_env.update({"PYTHONSAFEPATH": "1", **(env or {})})
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "llmc.cli.main", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout_s,
        env=child_env,
        preexec_fn=_limit_memory(memory_mb),
    )
    return Outcome(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0)


def assert_clean_failure(out: Outcome, exit_code: int, says: Sequence[str] = ()) -> None:
    """The promises of a failed command: its exit code, a message, no traceback, no stdout."""
    detail = f"exit {out.exit_code}, stderr: {out.stderr[-2000:]!r}, stdout: {out.stdout[-500:]!r}"
    assert out.exit_code == exit_code, detail
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, detail
    assert out.stdout.strip() == "", detail
    assert out.stderr.strip(), detail
    for fragment in says:
        assert fragment in out.stderr, f"{fragment!r} not in the error; {detail}"


def run_case(case: Case, **fill: object) -> Outcome:
    """Run one case with ``{name}`` placeholders of its args filled from ``fill``."""
    args = [str(a).format(**fill) for a in case.args]
    out = run_llmc(
        args, stdin=case.stdin, timeout_s=case.timeout_s, memory_mb=case.memory_mb, env=case.env
    )
    assert_clean_failure(out, case.exit_code, [s.format(**fill) for s in case.says])
    return out
