"""``ResponseBridge``: one replica's Responses carried from its Executor to the event loop.

The Executor's loop thread makes each step's Responses. Instead of one waiting thread per
HTTP request (``asyncio.to_thread(await_responses, id)``, a thread wake per request per
step) or a dispatcher thread per replica (one more thread to wake and to win the GIL from
the engine thread, per step), the bridge is the Executor's response sink
(``Executor.set_response_sink``): the engine thread itself posts each step's batch to the
event loop with one ``call_soon_threadsafe``, before it schedules the next step. On the
loop, each Response goes to the ``Channel`` of the HTTP request that owns its id.

Invariants:
- ``submit`` enqueues and registers in one event-loop callback (no await between), and
  batches are delivered by callbacks on that same loop, so a request's Responses (even an
  immediate error) are never delivered before its channel exists.
- A request id stays registered until its final Response was delivered: ``open`` is the
  number of the replica's requests the engine has not finished (a cancelled request counts
  until its cancel is applied), the load ``least_loaded`` routing and ``--max_queue`` read.
- Delivery to a closed channel (a disconnected client) is dropped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from llmc.runtime.responses import Response
from llmc.runtime.types import Request


class Channel:
    """The Responses of one HTTP request (one or more engine requests), as they arrive.

    ``take()`` waits for at least one and returns every one ready (with its arrival time),
    so a reader that fell behind catches up with one wake-up."""

    __slots__ = ("_items", "_waiter", "closed")

    def __init__(self) -> None:
        self._items: list[tuple[float, Response]] = []
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False

    def push(self, when: float, response: Response) -> None:
        self._items.append((when, response))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def interrupt(self) -> None:
        """The reader's client left: close the channel and wake the reader."""
        self.closed = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list[tuple[float, Response]]:
        """Every Response ready (waiting for one); [] once the channel is closed."""
        while not self._items:
            if self.closed:
                return []
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class ResponseBridge:
    """The response sink of one ``llmc.LLM``'s Executor (see the module docstring)."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop, name: str = "") -> None:
        self.llm, self.loop, self.name = llm, loop, name
        self._channels: dict[int, Channel] = {}
        self._executor = llm.executor
        self._executor.set_response_sink(self._post)

    @property
    def open(self) -> int:
        """Requests of this replica the engine has not finished."""
        return len(self._channels)

    def submit(self, requests: list[Request], channel: Channel) -> list[int]:
        """Enqueue ``requests`` (on the event loop) with ``channel`` receiving their
        Responses; returns their ids. Raises what ``enqueue_request`` raises (EngineError
        when the engine loop failed), after cancelling the ones already queued."""
        ids: list[int] = []
        try:
            for req in requests:
                rid = self.llm.enqueue_request(req)
                self._channels[rid] = channel
                ids.append(rid)
        except BaseException:
            self.cancel(ids)
            raise
        return ids

    def cancel(self, request_ids: list[int]) -> None:
        """Cancel unfinished requests (the client left); their blocks are freed at the next
        step and their ids stay open until the engine confirms."""
        for rid in request_ids:
            channel = self._channels.get(rid)
            if channel is not None:
                channel.closed = True
                self.llm.cancel_request(rid)

    def cancel_all(self) -> None:
        """Cancel every unfinished request of this replica (a drain that timed out)."""
        self.cancel(list(self._channels))

    def _deliver(self, when: float, batch: list[Response]) -> None:
        channels = self._channels
        for r in batch:
            channel = channels.get(r.request_id)
            if channel is None:
                continue
            if r.is_final:
                del channels[r.request_id]
            if not channel.closed:
                channel.push(when, r)

    def _post(self, batch: list[Response]) -> None:
        """The Executor's sink (its loop thread): one loop callback per step's batch."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, time.perf_counter(), batch)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def close(self) -> None:
        """Stop handing Responses to the loop (the LLM is the caller's to shut down)."""
        self._executor.set_response_sink(None)
