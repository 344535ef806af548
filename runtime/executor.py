"""Executor: requests in, streamed responses out, one in-flight-batching engine loop.

The loop has three verbs: ``Scheduler.schedule()`` → ``ModelRunner.step(batch)`` →
``Scheduler.update(batch, token_ids)`` (multi-step decoding: a decode-only batch may be a
window of K steps, ``plan_window`` / ``update_window``), then post-processing (detokenize,
stop strings, responses, records: runtime/engine_step.py, which also holds the async-scheduling rule
``ahead_ok``). This module owns requests, the lock and the loop. It runs in the caller's
thread (``step``, ``run_until_complete``, ``await_responses`` and ``generate`` drive it) or
in a background thread (``start`` / ``shutdown``), as TensorRT-LLM's Executor does.

Invariants:
- A bad request never stops the engine: validation, tokenization and ``Scheduler.add``
  errors become an immediate final Response with ``finish_reason=ERROR`` and the message
  (``request N: ...``, the prefix added once, by ``RequestState.error_response``); a
  ``RequestFault`` inside a step (one request's step inputs, sampling columns, logprobs,
  detokenization or stop strings broke) fails that request alone, frees its KV blocks, and
  the step runs on without it. A failure of the step itself (the model forward) still
  fails every open request and stops the loop.
- Every request gets exactly one final Response (``is_final``), after which no other.
- For a streaming request, the concatenation of every ``new_text`` equals the final
  ``text``, and of every ``new_token_ids`` the final ``token_ids``. A non-streaming request
  gets only its final Response, which carries everything.
- Thread safety: one condition variable guards all state; ``enqueue_request``,
  ``cancel_request`` and ``await_responses`` may be called from any thread. The loop holds
  the lock while it schedules and updates, never while the model runs. Cancellations are
  applied at the start of the next step, so a running step never loses its blocks.
- One RequestRecord per request and one StepRecord per step (runtime/records.py).
- With a response sink (``set_response_sink``), the loop thread hands a step's Responses to
  it in one call before it schedules the next step; ``await_responses`` then gets none.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, Protocol

from llmc.base.errors import EngineError, LlmcError, RequestError
from llmc.compiler.limits import check_positive_int
from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.engine_step import (
    AHEAD_BUSY_ROWS,
    InFlight,
    ahead_ok,
    ahead_src_rows,
    emit_step_responses,
    request_output,
    stamp_scheduled,
    step_record,
)
from llmc.runtime.records import RequestRecord, StepRecord
from llmc.runtime.request_intake import prompt_ids, requests_for
from llmc.runtime.request_state import RequestState
from llmc.runtime.responses import RequestOutput, Response
from llmc.runtime.token_runs import TokenRuns
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.types import (
    FinishReason,
    Request,
    RequestFault,
    SamplingParams,
    ScheduledBatch,
    Sequence,
)


class Runner(Protocol):
    def step(self, batch: ScheduledBatch) -> Any: ...


def _now() -> float:
    return time.perf_counter()


class Executor:
    """In-flight-batching executor over a Scheduler and a ModelRunner.

    ``engine`` is anything with ``runner``, ``scheduler``, ``tokenizer`` (or None) and
    ``vocab_size`` attributes: an ``EngineRuntime`` or an ``ExecutorParts``.
    """

    def __init__(
        self,
        engine: Any,
        *,
        async_scheduling: bool | None = None,
        decode_steps_per_iteration: int | None = None,
        ahead_busy_rows: int = AHEAD_BUSY_ROWS,
    ) -> None:
        """``decode_steps_per_iteration`` (None: the engine's, else 1): K of multi-step
        decoding (``Scheduler.plan_window``); the runner must serve window batches.
        ``ahead_busy_rows``: async scheduling launches the next step ahead of a step of at
        least this many rows even when its ids are first or last tokens (``ahead_ok``)."""
        self.engine = engine
        if async_scheduling is None:  # the runtime's choice (RuntimeConfig, CUDA only)
            async_scheduling = bool(getattr(engine, "async_scheduling", False))
        if decode_steps_per_iteration is None:
            decode_steps_per_iteration = int(getattr(engine, "decode_steps_per_iteration", 1))
        check_positive_int("decode_steps_per_iteration", decode_steps_per_iteration)
        check_positive_int("ahead_busy_rows", ahead_busy_rows)
        self.ahead_busy_rows = ahead_busy_rows
        self.decode_steps = decode_steps_per_iteration
        self.runner: Runner = engine.runner
        self.async_scheduling = async_scheduling and hasattr(self.runner, "launch")
        self._inflight: InFlight | None = None
        self.num_ahead_steps = 0
        """Steps launched by async scheduling before the previous step's tokens were known."""
        self.scheduler = engine.scheduler
        self.tokenizer: Tokenizer | None = getattr(engine, "tokenizer", None)
        self.vocab_size: int = int(engine.vocab_size)
        self._cv = threading.Condition(threading.RLock())
        self._step_lock = threading.Lock()  # one step at a time, whoever drives the loop
        self._next_id = 0
        self._states: dict[int, RequestState] = {}
        self._ready: list[Response] = []
        self._cancels: list[int] = []
        self._records: dict[int, RequestRecord] = {}
        self.step_records: list[StepRecord] = []
        self._runs: TokenRuns | None = TokenRuns()
        """Deferred decode rows' token times, once per step (runtime/token_runs.py; None:
        the per-row pass for every row)."""
        self._thread: threading.Thread | None = None
        self._stop_loop = False
        self._fatal: BaseException | None = None
        self._sink: Callable[[list[Response]], None] | None = None

    # ------------------------------------------------------------------ requests
    def enqueue_request(self, request: Request) -> int:
        """Queue a request; returns its id. A bad request gets a final error Response.

        Validation and tokenization (a chat template's rendering included, bounded by the
        tokenizer) run before the lock is taken, so a slow prompt never stalls the loop."""
        if not isinstance(request, Request):
            raise RequestError(f"enqueue_request takes a Request, got {type(request).__name__}")
        arrival = _now()
        error: LlmcError | None = None
        try:
            ids = prompt_ids(request, self.tokenizer, self.vocab_size)
        except LlmcError as e:
            ids, error = [], e
        with self._cv:
            if self._fatal is not None:
                raise EngineError(f"the engine loop failed and stopped: {self._fatal}")
            rid = self._next_id
            self._next_id += 1
            record = RequestRecord(request_id=rid, arrival_time=arrival, num_prompt_tokens=0)
            self._records[rid] = record
            state = RequestState(request=request, record=record, tokenizer=self.tokenizer)
            self._states[rid] = state
            if error is None:
                record.num_prompt_tokens = len(ids)
                seq = Sequence(
                    request_id=rid,
                    prompt_token_ids=ids,
                    sampling=request.sampling,
                    max_new_tokens=request.sampling.max_new_tokens,
                    arrival_time=record.arrival_time,
                    priority=request.priority,
                )
                try:
                    self.scheduler.add(seq)
                except LlmcError as e:
                    error = e
            if error is not None:
                self._fail(state, error)
                return rid
            state.seq = seq
            if self.tokenizer is not None:
                state.detok = IncrementalDetokenizer(self.tokenizer, request.sampling.stop)
            state.deferred = not request.streaming and not request.sampling.stop
            self._cv.notify_all()
            return rid

    def cancel_request(self, request_id: int) -> bool:
        """Cancel a queued or running request (applied at the next step; frees its blocks).

        Returns False when the request is unknown or already finished.
        """
        with self._cv:
            state = self._states.get(request_id)
            if state is None or state.final:
                return False
            self._cancels.append(request_id)
            self._cv.notify_all()
            return True

    # ------------------------------------------------------------------ responses
    def _emit(self, response: Response) -> None:
        self._ready.append(response)
        self._cv.notify_all()

    def _fail(self, state: RequestState, error: BaseException) -> None:
        self._emit(state.error_response(error))

    def _fail_request(self, fault: RequestFault) -> None:
        """One request's data broke a step: it alone fails (its blocks freed); under the lock."""
        rid = fault.request_id
        self.scheduler.finish(rid, FinishReason.ERROR)  # None when it had finished already
        state = self._states.get(rid)
        if state is not None and not state.final:
            self._fail(state, fault)

    def set_response_sink(self, sink: Callable[[list[Response]], None] | None) -> None:
        """Background loop: hand each step's Responses (and any made outside a step, e.g. an
        enqueue refusal) to ``sink`` (quick, never raising) from the loop thread; None: keep
        them for ``await_responses``."""
        with self._cv:
            self._sink = sink
            self._cv.notify_all()

    def _flush(self) -> None:
        """The ready Responses to the sink (the loop thread, outside the lock)."""
        sink = self._sink
        if sink is None:
            return
        with self._cv:
            got = self._take(None)
        if got:
            sink(got)

    def _take(self, request_ids: set[int] | None) -> list[Response]:
        if request_ids is None:
            taken, self._ready = self._ready, []
        else:
            taken = [r for r in self._ready if r.request_id in request_ids]
            if taken:
                self._ready = [r for r in self._ready if r.request_id not in request_ids]
        for r in taken:  # a delivered final response ends the request's state (records stay)
            if r.is_final:
                self._states.pop(r.request_id, None)
        return taken

    def _pending(self, request_ids: set[int] | None) -> bool:
        """Some selected request has not yet produced its final response."""
        if request_ids is None:
            return any(not s.final for s in self._states.values())
        return any((s := self._states.get(i)) is not None and not s.final for i in request_ids)

    def await_responses(
        self,
        request_ids: int | Seq[int] | None = None,
        timeout: float | None = None,
        max_steps: int | None = None,
    ) -> list[Response]:
        """Responses ready for the given requests (all when None), waiting up to ``timeout``
        seconds for at least one. Without a background loop, this call runs engine steps,
        at most ``max_steps`` of them (None: as many as it takes).

        Returns [] on timeout, after ``max_steps`` steps with nothing ready, or when the
        selected requests have nothing more to say.
        """
        ids = (
            {request_ids}
            if isinstance(request_ids, int)
            else (None if request_ids is None else set(request_ids))
        )
        deadline = None if timeout is None else _now() + timeout
        while True:
            with self._cv:
                got = self._take(ids)
                if got or not self._pending(ids):
                    return got
                remaining = None if deadline is None else deadline - _now()
                if remaining is not None and remaining <= 0:
                    return []
                if self._thread is not None:
                    self._cv.wait(remaining)
                    continue
            if max_steps is not None:
                if max_steps <= 0:
                    return []
                max_steps -= 1
            self.step()

    def generate(
        self,
        prompts: str | Seq[int] | Request | Seq[str | Seq[int] | Request],
        sampling: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        apply_chat_template: bool = False,
    ) -> list[RequestOutput]:
        """Blocking: run every prompt (text, token ids or a Request) to completion."""
        prompts, requests = requests_for(prompts, sampling, apply_chat_template)
        ids = [self.enqueue_request(req) for req in requests]
        with self._cv:  # what the outputs need once the requests' states are gone
            info = {i: (self._states[i].request, self._states[i].seq) for i in ids}
        finals: dict[int, Response] = {}
        parts: dict[int, list[Response]] = {i: [] for i in ids}
        while len(finals) < len(ids):
            for r in self.await_responses([i for i in ids if i not in finals]):
                parts[r.request_id].append(r)
                if r.is_final:
                    finals[r.request_id] = r
        return [
            request_output(i, prompts[n], parts[i], *info[i], self._records[i])
            for n, i in enumerate(ids)
        ]

    # ------------------------------------------------------------------ the loop
    @property
    def failed(self) -> bool:
        """The loop failed and stopped (every open request got an error response)."""
        return self._fatal is not None

    def has_work(self) -> bool:
        with self._cv:  # (Responses waiting for the sink are work of the loop thread too)
            return (
                bool(self._cancels)
                or self.scheduler.has_unfinished()
                or self._inflight is not None
                or (self._sink is not None and bool(self._ready))
            )

    def step(self) -> bool:
        """Run one engine step (cancellations, schedule, model, update); False if idle.

        With async scheduling, one call finishes one step (update and responses) after
        launching the next one when it can be scheduled ahead."""
        with self._step_lock:
            return self._step_async() if self.async_scheduling else self._step()

    def _schedule_next(self) -> InFlight | None:
        """Apply cancellations and schedule the next step (under the lock), stamping
        first-scheduled times; None when nothing is left. The step is not launched yet."""
        t0 = _now()
        with self._cv:
            self._apply_cancels()
            if not self.scheduler.has_unfinished():
                return None
            batch = self.scheduler.schedule()
            if self.decode_steps > 1:  # multi-step decoding, when the batch allows it
                batch = self.scheduler.plan_window(batch, self.decode_steps)
            stamp_scheduled(batch, self._states, t0)
            if batch.is_empty:
                raise RuntimeError(
                    f"step {batch.step_id}: the scheduler scheduled nothing although "
                    f"{self.scheduler.num_waiting} requests wait (scheduler bug)"
                )
            used = self.scheduler.kv.num_used_blocks
        return InFlight(batch, None, t0, _now() - t0, used)

    def _launch(self, cur: InFlight, launch: Any) -> Any:
        """``launch(cur.batch)``. A RequestFault (one request's data broke the step's per-row
        work, before any state changed) fails that request and the step runs again without
        its rows; any other failure is the engine's and propagates."""
        while True:
            try:
                return launch(cur.batch)
            except RequestFault as fault:
                rows = tuple(s for s in cur.batch.sequences if s.seq.request_id != fault.request_id)
                if len(rows) == len(cur.batch.sequences):
                    raise  # not a request of this step: nothing to isolate
                with self._cv:
                    self._fail_request(fault)
                cur.batch = dataclasses.replace(
                    cur.batch, sequences=rows, rows=None, prefix_rows=None
                )

    def _step(self) -> bool:
        cur = self._schedule_next()
        if cur is None:
            return False
        self._complete(cur, self._launch(cur, self.runner.step))
        return True

    def _step_async(self) -> bool:
        cur = self._inflight
        if cur is None:
            cur = self._schedule_next()
            if cur is None:
                return False
            cur.pending = self._launch(cur, self.runner.launch)
        self._inflight = None
        if ahead_ok(cur.batch, self.ahead_busy_rows):
            t0 = _now()
            with self._cv:  # the next step, scheduled before cur's tokens are known
                self._apply_cancels()
                ahead = self.scheduler.schedule_ahead(cur.batch)
                used = self.scheduler.kv.num_used_blocks
                if ahead:
                    stamp_scheduled(ahead, self._states, t0)
            if ahead:
                src = ahead_src_rows(cur.batch, ahead)
                t1 = _now()
                try:
                    pending = self.runner.launch(ahead, src)
                except RequestFault as fault:  # its request fails; the step is not run
                    with self._cv:  # (its rows' next step is scheduled after cur's update)
                        self._fail_request(fault)
                else:
                    self._inflight = InFlight(ahead, pending, t0, t1 - t0, used)
                    self.num_ahead_steps += 1
        assert cur.pending is not None
        self._complete(cur, cur.pending.result())
        return True

    def _complete(self, cur: InFlight, out: Any) -> None:
        """Apply a computed step: scheduler update, responses, its StepRecord."""
        batch = cur.batch
        t2 = _now()
        with self._cv:
            if batch.window is None:
                self.scheduler.update(batch, list(out.token_ids), getattr(out, "branch_steps", ()))
            else:  # a cancel during the window ends its request now, with no window token
                self._apply_cancels()
                self.scheduler.update_window(batch, out.window_token_ids)
            emit_step_responses(
                batch, out, t2, self._states, self.scheduler, self._emit, self._runs
            )
            t3 = _now()
            self.step_records.append(step_record(cur, out, t2, t3, self.scheduler.kv.total_blocks))

    def _apply_cancels(self) -> None:
        for rid in self._cancels:
            state = self._states.get(rid)
            if state is None or state.final:
                continue
            self.scheduler.finish(rid, FinishReason.CANCELLED)
            try:
                self._emit(state.close(FinishReason.CANCELLED, _now()))
            except Exception as e:  # its text could not be finished: it fails instead
                self._fail(state, RequestFault.caused(rid, "finishing its text", e))
        self._cancels.clear()

    def run_until_complete(self) -> None:
        """Step until every queued request has finished (caller-thread mode)."""
        while self.step():
            pass

    # ------------------------------------------------------------------ background loop
    def start(self) -> Executor:
        """Run the engine loop in a background thread (until ``shutdown``)."""
        with self._cv:
            if self._thread is None:
                self._stop_loop = False
                self._thread = threading.Thread(target=self._loop, name="llmc-executor")
                self._thread.daemon = True
                self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop_loop and not self.has_work():
                    self._cv.wait()
                if self._stop_loop:
                    return
            try:
                self.step()
            except BaseException as e:  # fail every open request; the engine is unusable
                with self._cv:
                    self._fatal = e
                    for state in self._states.values():
                        if not state.final:
                            self._fail(state, EngineError(f"engine failure: {e!r}"))
                self._flush()
                return
            self._flush()

    def shutdown(self) -> None:
        """Stop the background loop (requests in flight stay queued; step() can resume)."""
        with self._cv:
            thread, self._thread = self._thread, None
            self._stop_loop = True
            self._cv.notify_all()
        if thread is not None:
            thread.join()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ introspection
    @property
    def request_records(self) -> list[RequestRecord]:
        with self._cv:
            if self._runs is not None:
                self._runs.settle_all()
            return list(self._records.values())

    def request_record(self, request_id: int) -> RequestRecord | None:
        """The RequestRecord of one request (None when unknown), without copying them all."""
        with self._cv:
            state = self._states.get(request_id)
            if state is not None:
                state.settle()
            return self._records.get(request_id)

    def kv_stats(self) -> Any:
        return self.scheduler.kv.stats()

    def scheduler_stats(self) -> Any:
        return self.scheduler.stats()
