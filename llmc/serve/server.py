"""``serve``: run the server until it is stopped; its exit code.

Order: uvicorn binds and answers first (``/health`` says 503 ``loading``), a thread loads
every replica, then the phase becomes ``ready``. A load failure stops the server with that
error's exit code. SIGTERM (or a first Ctrl-C) drains: the phase becomes ``draining`` (new
``/v1`` requests and ``/health`` get 503 with Retry-After; the socket stays open so that
clients get an answer, not a refused connection), in-flight generations get up to
``drain_timeout`` seconds to finish, what is left is then cancelled, and the process exits
0. A second Ctrl-C exits at once.

The event loop is uvloop when installed and HTTP parsing httptools (uvicorn's ``auto``; the
``ready`` line names both); the interpreter's GIL switch interval is lowered while serving,
so the Executor's loop thread gets the GIL back promptly from the event loop at every step.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from llmc.runtime.gc_heap import freeze_heap, unfreeze_heap
from llmc.serve.app import ServerState, create_app
from llmc.serve.config import ServeConfig
from llmc.serve.engines import EnginePool

SWITCH_INTERVAL_S = 0.0005
log = logging.getLogger("llmc.serve")


class _Server(uvicorn.Server):
    """uvicorn's server with engine loading after bind and a draining SIGTERM."""

    def __init__(self, config: uvicorn.Config, state: ServerState, say: Callable[[str], None]):
        super().__init__(config)
        self.state, self.say = state, say
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        loop = self._loop = asyncio.get_running_loop()
        for server in getattr(self, "servers", []):
            for sock in server.sockets or ():
                host, port = sock.getsockname()[:2]
                self.say(f"llmc serve: listening on http://{host}:{port}")
        pool = self.state.pool
        threading.Thread(
            target=pool.load, args=(loop, self.say), name="llmc-serve-load", daemon=True
        ).start()
        loop.create_task(self._await_load())

    async def _await_load(self) -> None:
        pool = self.state.pool
        while not pool.loaded.is_set():
            await asyncio.sleep(0.05)
        if pool.error is not None:
            e = pool.error
            self.say(f"error: loading the engines failed: {e}")
            self.exit_code = int(getattr(e, "exit_code", 1))
            self.should_exit = True
        elif self.state.phase == "loading":
            freeze_heap()  # the engines' objects, walked by no collection while serving
            self.state.phase = "ready"
            loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
            proto = getattr(self.config, "http_protocol_class", None)
            http = getattr(proto, "__name__", "?").removesuffix("Protocol").lower()
            self.say(f"llmc serve: ready (event loop {loop}, HTTP {http})")

    async def shutdown(self, sockets: Any = None) -> None:
        try:
            await super().shutdown(sockets=sockets)
        finally:
            unfreeze_heap()  # frozen at "ready" (_await_load)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit or self._loop is None or self.state.phase != "ready":
            if self.state.phase == "draining" and sig == signal.SIGTERM:
                return  # already draining
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # exit with our code, not by the signal again
            return
        self.state.phase = "draining"
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        state = self.state
        timeout = float(state.config.drain_timeout)
        self.say(f"llmc serve: draining ({state.active} in flight, up to {timeout:g} s)")
        if not await state.drained(timeout):
            self.say(f"llmc serve: drain timed out; cancelling {state.active} requests")
            state.pool.cancel_all()
            await state.drained(5.0)
        self.should_exit = True


def make_server(config: ServeConfig, say: Callable[[str], None] | None = None) -> _Server:
    """The server of ``config``, not started (``run()`` serves until it should exit; off the
    main thread it installs no signal handlers and stops when ``should_exit`` is set)."""
    speak = say or (lambda m: print(m, file=sys.stderr, flush=True))
    state = ServerState(config, EnginePool(config))
    uv = uvicorn.Config(
        create_app(state),
        host=config.host,
        port=config.port,
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )
    return _Server(uv, state, speak)


def serve(config: ServeConfig, say: Callable[[str], None] | None = None) -> int:
    """Serve until stopped; returns the process exit code (0 after a drain)."""
    server = make_server(config, say)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits when it cannot bind (it logged why)
        return int(e.code) if isinstance(e.code, int) else 1
    finally:
        sys.setswitchinterval(previous)
        server.state.pool.shutdown()
    return server.exit_code
