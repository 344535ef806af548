"""``EnginePool``: the served models, each one or more replicas, and choosing one.

A ``Replica`` is one ``llmc.LLM`` (its own Executor loop thread) with its ``ResponseBridge``;
the pool loads every replica (in a thread, so the server answers ``/health`` with 503 while
it loads), picks a replica of the request's ``model`` by the routing policy (``pick``), and
refuses with 503 + Retry-After when the chosen replica already holds ``max_batch_size +
max_queue`` unfinished requests (``admit``). Shutdown detaches each bridge, then stops each
LLM (which cancels what is left and frees the device memory).

Invariant: ``pick``, ``admit`` and ``Replica.load`` run on the event loop only; loading runs in one
thread and publishes a replica by setting its ``llm`` last.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from llmc.base.errors import LlmcError
from llmc.base.text import printable
from llmc.serve.api_errors import APIError, unavailable
from llmc.serve.bridge import ResponseBridge
from llmc.serve.config import ServeConfig
from llmc.serve.routing import make_policy


class Replica:
    """One loaded engine serving one model name."""

    def __init__(self, model: str, index: int, engine_dir: str) -> None:
        self.model, self.index, self.engine_dir = model, index, engine_dir
        self.llm: Any = None
        self.bridge: ResponseBridge | None = None
        self.limits: dict[str, Any] = {}

    @property
    def ready(self) -> bool:
        return self.bridge is not None

    @property
    def load(self) -> int:
        """Engine requests submitted here and not yet finished."""
        return self.bridge.open if self.bridge is not None else 0

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_seq_len(self) -> int:
        return int(self.limits["max_seq_len"])

    def stats(self) -> tuple[Any, Any] | None:
        """(SchedulerStats, KVCacheStats) now; None before loading or after shutdown."""
        llm = self.llm
        if llm is None or llm.closed:
            return None
        return llm.scheduler_stats(), llm.kv_stats()


class EnginePool:
    """Every replica of every model of a ServeConfig."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.models: dict[str, list[Replica]] = {}
        for spec in config.engines:
            group = self.models.setdefault(spec.name, [])
            group.append(Replica(spec.name, len(group), spec.engine_dir))
        self._policies = {name: make_policy(config.routing) for name in self.models}
        self.error: LlmcError | BaseException | None = None
        """Why loading failed (the server then exits with its code)."""
        self.loaded = threading.Event()

    def replicas(self) -> list[Replica]:
        return [r for group in self.models.values() for r in group]

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.error is None

    # ---- loading ----------------------------------------------------------------------
    def load(self, loop: asyncio.AbstractEventLoop, log: Any = print) -> None:
        """Load every replica (blocking; run in a thread). Sets ``error`` on failure."""
        from llmc.api import LLM

        try:
            for r in self.replicas():
                llm = LLM(engine_dir=r.engine_dir, runtime_config=self.config.runtime)
                r.limits = llm.summary()
                r.llm = llm
                r.bridge = ResponseBridge(llm, loop, f"{r.model}-{r.index}")
                info = r.limits
                log(
                    f"loaded {r.model} (replica {r.index}) from {r.engine_dir} on "
                    f"{info['device']} ({info['backend']} backend); KV cache "
                    f"{info['kv_blocks']} blocks ({info['kv_tokens']} tokens)"
                )
        except BaseException as e:  # reported by the server, which then exits
            self.error = e
        finally:
            self.loaded.set()

    # ---- routing ----------------------------------------------------------------------
    def pick(self, model: Any) -> Replica:
        """The replica of ``model`` the routing policy gives the next request: 404 for an
        unknown model, 503 while it loads."""
        group = self.models.get(model) if isinstance(model, str) else None
        if group is None:
            raise APIError(
                404,
                f"the model {printable(repr(model))[:200]} does not exist; this server "
                "serves " + ", ".join(repr(m) for m in self.models),
                param="model",
                code="model_not_found",
            )
        ready = [r for r in group if r.ready]
        if not ready:
            raise unavailable("the server is loading its engines", self.config.retry_after_s)
        return ready[self._policies[model].pick(ready)]

    def admit(self, replica: Replica, need: int) -> None:
        """503 (Retry-After) when ``need`` more engine requests would take ``replica`` past
        max_batch_size + max_queue unfinished ones."""
        cap = int(replica.limits["max_batch_size"]) + self.config.max_queue
        if replica.load + need > cap:
            raise unavailable(
                f"the server is busy: model {replica.model!r} replica {replica.index} holds "
                f"{replica.load} unfinished requests (max_batch_size + max_queue = {cap}); "
                "retry later",
                self.config.retry_after_s,
                code="queue_full",
            )

    # ---- shutdown ---------------------------------------------------------------------
    def cancel_all(self) -> None:
        """Cancel every unfinished request (the drain timed out)."""
        for r in self.replicas():
            if r.bridge is not None:
                r.bridge.cancel_all()

    def shutdown(self) -> None:
        for r in self.replicas():
            bridge, llm = r.bridge, r.llm
            r.bridge = None
            if bridge is not None:
                bridge.close()
            if llm is not None:
                llm.shutdown()
