"""Error types of llmc and the process exit code each maps to.

Every error a user can cause is one of these, raised with a message that names the input
and, where possible, how to fix it. The CLI prints the message (no traceback) and exits
with the class's ``exit_code``; the codes are documented in README.md and never reused.
"""

from __future__ import annotations

__all__ = [
    "LlmcError",
    "UsageError",
    "ConfigError",
    "CheckpointError",
    "UnsupportedError",
    "CapacityError",
    "EngineError",
    "RequestError",
    "BenchFailure",
    "did_you_mean",
]


class LlmcError(Exception):
    """Base class; ``exit_code`` is the process exit status the CLI uses."""

    exit_code = 1


class UsageError(LlmcError):
    """Bad command line: unknown flag, unknown YAML key, YAML that is not a mapping."""

    exit_code = 2


class ConfigError(LlmcError):
    """A value that is out of range or inconsistent (max_input_len > max_seq_len, ...)."""

    exit_code = 3


class CheckpointError(LlmcError):
    """A checkpoint that is missing, truncated, corrupt, or has wrong/missing tensors."""

    exit_code = 4


class UnsupportedError(LlmcError):
    """An architecture, dtype or target llmc does not support."""

    exit_code = 5


class CapacityError(LlmcError):
    """The configuration does not fit in device memory (one max_seq_len request must fit)."""

    exit_code = 6


class EngineError(LlmcError):
    """An engine directory that is incomplete, corrupt, or built for another version/target."""

    exit_code = 7


class RequestError(LlmcError):
    """A request that cannot be served (too long, bad sampling values, ...).

    Raised per request; the runtime keeps serving the others.
    """

    exit_code = 8


class BenchFailure(LlmcError):
    """A benchmark in which requests failed (above --max_failure_rate)."""

    exit_code = 9


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ' (did you mean X?)' for the closest choice, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(name.replace("-", "_"), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
