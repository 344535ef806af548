"""Error types of llmc and the process exit code each maps to.

Every error a user can cause is one of these, raised with a message that names the input
and, where possible, how to fix it. The CLI prints the message (no traceback) and exits
with the class's ``exit_code``; the codes are documented in README.md and never reused.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    "check_positive_ints",
    "did_you_mean",
    "error_class",
]


_BY_EXIT_CODE: dict[int, type[LlmcError]] = {}


class LlmcError(Exception):
    """Base class; ``exit_code`` is the process exit status the CLI uses.

    A subclass names its own code in its class line (``class X(LlmcError, exit_code=N)``);
    one that names none shares its parent's. A code already taken is a TypeError at import,
    so two kinds of failure never share an exit status.
    """

    exit_code = 1

    def __init_subclass__(cls, *, exit_code: int | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if exit_code is None:
            return
        if exit_code in _BY_EXIT_CODE or exit_code in (0, 1):  # 0 success, 1 internal error
            owner = getattr(_BY_EXIT_CODE.get(exit_code), "__name__", "success/internal error")
            raise TypeError(f"{cls.__name__}: exit code {exit_code} is taken ({owner})")
        cls.exit_code = exit_code
        _BY_EXIT_CODE[exit_code] = cls


def error_class(exit_code: int | None) -> type[LlmcError]:
    """The error class of an exit code (LlmcError for 1 or a code no class has)."""
    return _BY_EXIT_CODE.get(exit_code, LlmcError) if exit_code is not None else LlmcError


class UsageError(LlmcError, exit_code=2):
    """Bad command line: unknown flag, unknown YAML key, YAML that is not a mapping."""


class ConfigError(LlmcError, ValueError, exit_code=3):
    """A value that is out of range or inconsistent (max_input_len > max_seq_len, ...).

    Also a ``ValueError``: what code ported from vLLM / TensorRT-LLM catches."""


class CheckpointError(LlmcError, exit_code=4):
    """A checkpoint that is missing, truncated, corrupt, or has wrong/missing tensors."""


class UnsupportedError(LlmcError, exit_code=5):
    """An architecture, dtype or target llmc does not support."""


class CapacityError(LlmcError, exit_code=6):
    """The configuration does not fit in device memory (one max_seq_len request must fit)."""


class EngineError(LlmcError, exit_code=7):
    """An engine directory that is incomplete, corrupt, or built for another version/target."""


class RequestError(LlmcError, ValueError, exit_code=8):
    """A request that cannot be served (too long, bad sampling values, ...).

    Raised per request; the runtime keeps serving the others. Also a ``ValueError``, as
    ``ConfigError``.
    """


class BenchFailure(LlmcError, exit_code=9):
    """A benchmark in which requests failed (above --max_failure_rate)."""


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ' (did you mean X?)' for the closest choice, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(name.replace("-", "_"), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_positive_ints(values: Mapping[str, object], where: str, error: type[LlmcError]) -> None:
    """Raise ``error`` naming the first of ``values`` that is not an int > 0 (bools, being
    ints, pass as 1 / fail as 0, as ``isinstance`` sees them)."""
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise error(f"{where}: {name} must be a positive integer, got {value!r}")
