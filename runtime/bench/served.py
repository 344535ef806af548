"""``Served``: what the measurement wing needs from the engine it measures.

The wing sits below the front door (``llmc.api``), so it never imports ``LLM``; it takes one
and reads it through this protocol. ``llmc.LLM`` satisfies it; nothing else has to. The
workload driver uses the request verbs and ``in_caller_thread``; the profiler and the
bench result read the records, ``summary()``, ``config`` and the loaded ``runtime`` (model
spec, engine manifest and plan, device, backend, tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.records import RequestRecord, StepRecord
from llmc.runtime.responses import Response
from llmc.runtime.types import Request


class Served(Protocol):
    """An engine loaded and served: ``llmc.LLM`` (see its docstrings for each member)."""

    engine_dir: Path
    config: RuntimeConfig

    @property
    def runtime(self) -> EngineRuntime: ...

    @property
    def request_records(self) -> list[RequestRecord]: ...

    @property
    def step_records(self) -> list[StepRecord]: ...

    def summary(self) -> dict[str, Any]: ...

    def enqueue_request(self, request: Request) -> int: ...

    def await_responses(
        self,
        request_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
        max_steps: int | None = None,
    ) -> list[Response]: ...

    def in_caller_thread(self) -> AbstractContextManager[Any]: ...

    def shutdown(self) -> None: ...
