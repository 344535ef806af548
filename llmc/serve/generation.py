"""One HTTP request's generation: its engine requests submitted, answered, cancelled.

``GenerationResponse`` is the ASGI response of a completion or chat request. It submits the
Plan's engine requests to the chosen replica (``ResponseBridge.submit``) and then, while a
task watches the connection for the client leaving:

- streamed: waits for the first Responses. An engine refusal that arrives before any token
  (prompt over max_input_len, prompt + max_tokens over max_seq_len) still gets its 400 with
  the error object; otherwise the 200 event stream starts: one chunk per batch of Responses
  (a reader that fell behind merges each choice's deltas into one chunk), the finish reason
  on a choice's last chunk, then the usage chunk (``stream_options.include_usage``) and
  ``data: [DONE]``. A failure after the stream started is sent as an error event, then
  ``[DONE]``.
- whole: waits for every final Response and answers one JSON body with ``usage``.

Invariants: a client that disconnects cancels every unfinished engine request of its HTTP
request at once (the Executor frees their KV blocks at its next step); an exception in this
code fails this request alone (500, logged with its traceback on the server, never sent);
``on_done`` is called exactly once, when the response is over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response as StarletteResponse

from llmc.serve.api_errors import APIError
from llmc.serve.bridge import Channel
from llmc.serve.engines import Replica
from llmc.serve.formatting import (
    DONE,
    Shape,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    token_texts,
    usage,
)
from llmc.serve.metrics import ServerMetrics
from llmc.serve.translate import Plan, response_error

log = logging.getLogger("llmc.serve")
RAW_SEND = "llmc.raw_send"
"""Scope key of the server's own ``send`` (set by ``app.Gate``)."""
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _Choice:
    """What one choice has sent so far."""

    __slots__ = ("index", "chars", "tokens", "last_time", "final", "started")

    def __init__(self, index: int) -> None:
        self.index = index
        self.chars = 0
        self.tokens = 0
        self.last_time: float | None = None
        self.final: Any = None
        self.started = False


class GenerationResponse(StarletteResponse):
    """The answer of one completion / chat request (see the module docstring)."""

    def __init__(
        self,
        replica: Replica,
        plan: Plan,
        shape: Shape,
        metrics: ServerMetrics,
        arrival: float,
        on_done: Callable[[str], None],
    ) -> None:
        self.replica, self.plan, self.shape, self.metrics = replica, plan, shape, metrics
        self.arrival, self.on_done = arrival, on_done
        self.channel = Channel()
        assert replica.bridge is not None
        self.bridge = replica.bridge
        self.ids = self.bridge.submit(plan.requests(), self.channel)  # EngineError → 500
        self.choices = {rid: _Choice(i) for i, rid in enumerate(self.ids)}
        self.texts = token_texts(replica.tokenizer) if plan.num_top_logprobs is not None else None
        self.first_token: float | None = None
        self.model_metrics = metrics.of_model(replica.model)
        self.status_code = 200
        self.background = None

    # ---- ASGI -------------------------------------------------------------------------
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        started = False
        outcome = "server_error"
        try:
            if self.plan.streaming:
                outcome = await self._stream(send, scope.get(RAW_SEND, send))
            else:
                outcome = await self._whole(send)
        except APIError as e:  # raised before anything was sent
            await _send_error(send, e)
            outcome = "client_error" if e.status < 500 else "server_error"
        except (asyncio.CancelledError, OSError):
            outcome = "cancelled"
            raise
        except Exception:
            log.exception("request %s failed", self.shape.id)
            started = self.status_code == -1
            err = APIError(500, "internal error while serving the request", code="internal_error")
            try:
                if started:
                    await send({"type": "http.response.body", "body": err.sse_event() + DONE})
                else:
                    await _send_error(send, err)
            except Exception:  # the connection is gone as well
                pass
        finally:
            watcher.cancel()
            left = [rid for rid, c in self.choices.items() if c.final is None]
            if left:
                self.bridge.cancel(left)
                if outcome == "success":
                    outcome = "cancelled"
            self._account(outcome)
            self.on_done(outcome)

    async def _watch(self, receive: Any) -> None:
        """Wait for the client to leave; then wake the reader (which cancels)."""
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self.channel.interrupt()
                return

    def _account(self, outcome: str) -> None:
        m = self.model_metrics
        self.metrics.outcome(self.replica.model, outcome)
        m.e2e.observe(time.perf_counter() - self.arrival)
        if outcome == "success":
            m.prompt_tokens.inc(sum(len(p) for p in self.plan.prompts))
        generated = sum(c.tokens for c in self.choices.values())
        if generated:
            m.generation_tokens.inc(generated)

    # ---- the two shapes of an answer ----------------------------------------------------
    def _refusal(self, items: list[tuple[float, Any]]) -> APIError | None:
        """An engine refusal among the first Responses (before any token): its 400/500."""
        for _, r in items:
            if r.is_final and r.error is not None:
                return response_error(self.plan, r.error, r.error_code)
        return None

    def _usage(self) -> dict[str, int]:
        return usage(
            sum(len(p) for p in self.plan.prompts), sum(c.tokens for c in self.choices.values())
        )

    async def _whole(self, send: Any) -> str:
        finals: dict[int, Any] = {}
        while len(finals) < len(self.ids):
            items = await self.channel.take()
            if not items:
                return "cancelled"
            for _, r in items:
                c = self.choices[r.request_id]
                if r.is_final:
                    if r.error is not None:
                        raise response_error(self.plan, r.error, r.error_code)
                    c.final = r
                    c.tokens = len(r.token_ids or ())
                    finals[c.index] = r
        choices = []
        for i in range(len(self.ids)):
            r = finals[i]
            choices.append(
                self.shape.choice(i, r.text or "", finish_reason(r.finish_reason), self._lp(r, 0))
            )
        body = json.dumps(self.shape.body(choices, self._usage())).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return "success"

    async def _stream(self, send: Any, body_send: Any) -> str:
        """``send`` starts the response through every middleware (which then knows it has
        started); the body chunks go to ``body_send``, the server's own send (the Gate puts
        it in the scope), past the middlewares' per-message wrappers."""
        items = await self.channel.take()
        if not items:
            return "cancelled"
        refusal = self._refusal(items)
        if refusal is not None:
            raise refusal
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.status_code = -1  # started: a failure now goes into the stream
        open_choices = len(self.ids)
        while True:
            events, failure = self._events(items)
            open_choices = sum(c.final is None for c in self.choices.values())
            if failure is not None:
                await body_send({"type": "http.response.body", "body": failure.sse_event() + DONE})
                return "client_error" if failure.status < 500 else "server_error"
            if not open_choices:
                tail = self.shape.usage_chunk(self._usage()) if self.plan.include_usage else ""
                body = (events + tail).encode() + DONE
                await body_send({"type": "http.response.body", "body": body})
                return "success"
            if events:
                await body_send(
                    {"type": "http.response.body", "body": events.encode(), "more_body": True}
                )
            items = await self.channel.take()
            if not items:
                return "cancelled"

    def _events(self, items: list[tuple[float, Any]]) -> tuple[str, APIError | None]:
        """The stream chunk of a batch of Responses (each choice's deltas merged), or the
        error of a choice that failed."""
        merged: dict[int, list[Any]] = {}
        m = self.model_metrics
        for when, r in items:
            c = self.choices[r.request_id]
            if r.is_final and r.error is not None:
                c.final = r
                return "", response_error(self.plan, r.error, r.error_code)
            n = len(r.new_token_ids)
            if n:
                if self.first_token is None:
                    self.first_token = when
                    m.ttft.observe(when - self.arrival)
                    self._observe_stages(r.request_id)
                elif c.last_time is not None:
                    m.itl.observe((when - c.last_time) / n)
                c.last_time = when
                c.tokens += n
            if r.is_final:
                c.final = r
            merged.setdefault(c.index, []).append(r)
        parts = []
        for index, rs in merged.items():
            c = self.choices[self.ids[index]]
            text = "".join(r.new_text for r in rs)
            last = rs[-1]
            reason = finish_reason(last.finish_reason) if last.is_final else None
            lp = None
            if self.texts is not None:
                entries = [e for r in rs for e in (r.logprobs or ())]
                lp = self._format_lp(entries, c.chars)
            parts.append(self.shape.choice_chunk(index, text, reason, lp, first=not c.started))
            c.started = True
            c.chars += len(text)
        return (self.shape.chunk(parts) if parts else ""), None

    def _observe_stages(self, request_id: int) -> None:
        """Split this request's time to first token by stage (metrics.FIRST_TOKEN_STAGES)
        from the engine's record of its first engine request; once per HTTP request."""
        rec = self.replica.llm.executor.request_record(request_id)
        if rec is None or rec.scheduled_time is None or rec.first_token_time is None:
            return
        marks = (self.arrival, rec.arrival_time, rec.scheduled_time, rec.first_token_time)
        ends = (*marks[1:], time.perf_counter())
        for hist, start, end in zip(self.model_metrics.stages, marks, ends, strict=True):
            hist.observe(max(0.0, end - start))

    def _lp(self, r: Any, offset: int) -> Any:
        if self.texts is None:
            return None
        return self._format_lp(list(r.logprobs or ()), offset)

    def _format_lp(self, entries: list[Any], offset: int) -> Any:
        assert self.texts is not None
        if self.plan.logprobs_style == "chat":
            return chat_logprobs(entries, self.texts)
        return completion_logprobs(entries, self.texts, offset)


async def _send_error(send: Any, error: APIError) -> None:
    body = error.body_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
