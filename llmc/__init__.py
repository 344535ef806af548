"""llmc: compile LLM checkpoints into engine directories and serve them.

The package is split into subpackages mapped from the repository's top-level folders:
``llmc.cli`` (cli/), ``llmc.compiler`` (compiler/), ``llmc.runtime`` (runtime/),
``llmc.cuda`` (cuda/) and ``llmc.profiles`` (profiles/).

The Python API (docs/PYTHON_API.md)::

    from llmc import LLM, SamplingParams, BuildConfig, build, Profiler
    from llmc import RequestOutput, CompletionOutput, Logprob  # vLLM's output shapes

Those names are imported lazily (module ``__getattr__``): ``import llmc`` loads neither torch
nor the runtime, so ``llmc build --dry_run`` and ``llmc --help`` stay fast. Each name is the
object the CLI itself uses (``llmc.build is llmc.compiler.builder.build``), never a copy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmc.base.version import ENGINE_FORMAT_VERSION, __version__

_LAZY: dict[str, tuple[str, str]] = {
    "LLM": ("llmc.api", "LLM"),
    "GenerationOutput": ("llmc.runtime.responses", "RequestOutput"),
    "RequestOutput": ("llmc.runtime.responses", "RequestOutput"),
    "CompletionOutput": ("llmc.runtime.responses", "CompletionOutput"),
    "RequestMetrics": ("llmc.runtime.responses", "RequestMetrics"),
    "Logprob": ("llmc.runtime.logprobs", "Logprob"),
    "RequestTimings": ("llmc.runtime.responses", "RequestTimings"),
    "SamplingParams": ("llmc.runtime.types", "SamplingParams"),
    "BeamSearchParams": ("llmc.runtime.branches", "BeamSearchParams"),
    "Request": ("llmc.runtime.types", "Request"),
    "RuntimeConfig": ("llmc.runtime.engine_runtime", "RuntimeConfig"),
    "BuildConfig": ("llmc.compiler.build_config", "BuildConfig"),
    "build": ("llmc.compiler.builder", "build"),
    "Profiler": ("llmc.profiler_api", "Profiler"),
}

__all__ = [
    "__version__",
    "ENGINE_FORMAT_VERSION",
    "LLM",
    "GenerationOutput",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
    "RequestTimings",
    "SamplingParams",
    "BeamSearchParams",
    "Request",
    "RuntimeConfig",
    "BuildConfig",
    "build",
    "Profiler",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these come from __getattr__
    from llmc.api import LLM
    from llmc.compiler.build_config import BuildConfig
    from llmc.compiler.builder import build
    from llmc.profiler_api import Profiler
    from llmc.runtime.branches import BeamSearchParams
    from llmc.runtime.engine_runtime import RuntimeConfig
    from llmc.runtime.logprobs import Logprob
    from llmc.runtime.responses import (
        CompletionOutput,
        RequestMetrics,
        RequestOutput,
        RequestTimings,
    )
    from llmc.runtime.responses import RequestOutput as GenerationOutput
    from llmc.runtime.types import Request, SamplingParams


def __getattr__(name: str) -> Any:
    """Resolve a public API name on first use (not cached: ``llmc.build`` always is the
    builder's current ``build``)."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'llmc' has no attribute {name!r}")
    module, attr = target
    return getattr(importlib.import_module(module), attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
