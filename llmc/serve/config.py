"""``ServeConfig``: every setting of ``llmc serve``, frozen and validated at construction.

Engines are ``EngineSpec(name, engine_dir)`` entries; two entries with one name are two
replicas of that model (each loads its own ``llmc.LLM``), chosen per request by the
routing policy. Every replica is loaded with the same ``RuntimeConfig`` (the runtime flags
``llmc run`` has). A bad value is a ConfigError naming it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.engine_runtime import RuntimeConfig

ROUTING_POLICIES = ("round_robin", "least_loaded")
DEFAULT_MAX_BODY_BYTES = 16 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class EngineSpec:
    """One replica: the model name clients send as ``model`` and its engine directory."""

    name: str
    engine_dir: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                f"model name {self.name!r}: use 1-128 letters, digits and . _ : / - "
                "(starting with a letter or digit)"
            )

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """``NAME=DIR`` (the ``--engine`` flag) → EngineSpec; UsageError when malformed."""
        name, sep, directory = str(text).partition("=")
        if not sep or not name or not directory:
            raise UsageError(f"--engine {text!r}: expected NAME=DIR (e.g. llama=engines/llama)")
        return cls(name, directory)

    @classmethod
    def from_dir(cls, engine_dir: str) -> EngineSpec:
        """``--engine_dir DIR``: the model is named after the directory."""
        name = Path(engine_dir).resolve().name or "default"
        return cls(name if _NAME.match(name) else "default", engine_dir)


@dataclass(frozen=True)
class ServeConfig:
    """What ``llmc serve`` serves and how (see docs/SERVE.md for each setting)."""

    engines: tuple[EngineSpec, ...]
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    routing: str = "round_robin"
    max_queue: int = 1024
    """Requests a replica holds beyond its max_batch_size before new ones get 503."""
    drain_timeout: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM."""
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1
    """The Retry-After of a 503 (queue full, loading, draining)."""

    def __post_init__(self) -> None:
        if not self.engines:
            raise UsageError("no engine: give --engine_dir DIR or --engine NAME=DIR")
        object.__setattr__(self, "engines", tuple(self.engines))
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(
                f"routing {self.routing!r} is not one of {', '.join(ROUTING_POLICIES)}"
            )
        ints = {"port": (0, 65535), "max_queue": (0, 1 << 30), "max_body_bytes": (1024, 1 << 34)}
        for name, (lo, hi) in {**ints, "retry_after_s": (0, 3600)}.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        d = self.drain_timeout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0 <= d < math.inf):
            raise ConfigError(f"drain_timeout must be a finite number of seconds >= 0, got {d!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("api_key must be a non-empty string (or leave it out)")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host must be an address, got {self.host!r}")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Model names in first-given order, each once."""
        return tuple(dict.fromkeys(e.name for e in self.engines))
