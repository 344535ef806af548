"""One engine step's stages that need none of the Executor's locks or queues (no torch).

The Executor (runtime/executor.py) owns requests, the lock and the loop; this module owns
what is decided about, and made from, a single step:

- ``InFlight``: a launched step and what its StepRecord needs.
- ``ahead_ok``: the async-scheduling rule, whether the step after a batch may be launched
  before that batch's sampled ids reach the host; ``ahead_src_rows``: which of the earlier
  step's sampled ids feeds each row of the step launched ahead.
- ``emit_step_responses``: a computed step's sampled tokens → each request's Responses
  (token ids, detokenized text deltas, final responses). It reads the stop decisions
  ``Scheduler.update`` made (``Sequence.finish_reason``, ``stop_token_id``) and makes the
  only one that needs the text: a stop string, found by the detokenizer, finishes the
  sequence through ``Scheduler.finish``. A step of decode rows over slots keeps its deferred
  rows' token times in ``TokenRuns`` (runtime/token_runs.py): no Python pass over them.
- ``step_record``: a computed step's StepRecord (runtime/records.py); ``stamp_scheduled``:
  the first-scheduled time of a scheduled step's new requests.
- A multi-step window (``ScheduledBatch.window``) is caught up by the same
  ``emit_step_responses``: each row's new tokens go out in one burst; a request with stop
  strings has them detokenized one token at a time (``_window_text``), so a stop string
  inside the window cuts the output exactly where one step at a time would.
- ``request_output``: one request's Responses → the RequestOutput ``Executor.generate``
  returns.

Invariants:
- Nothing here keeps state or takes a lock. ``emit_step_responses`` mutates RequestStates
  and may finish sequences in the scheduler, so the caller holds the Executor's lock;
  the other functions are pure.
- Row *i* of a step's sampled ids and logprobs belongs to the *i*-th scheduled sequence
  with ``sample`` set (a prefill chunk that is not a prompt's last samples nothing).
- A request whose state is already final (cancelled, failed, stopped) gets no Response
  from a later step, so every request gets exactly one final Response.
- A row whose post-processing raises (detokenization, stop strings, logprobs) fails its
  request alone: it is finished in the scheduler (blocks freed) and gets an error Response.
- The text of a finishing EOS / stop token id is not part of the output text (its id is),
  and a stop string finishes the request in the scheduler at the step that completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from llmc.runtime import types
from llmc.runtime.records import RequestRecord, StepRecord
from llmc.runtime.request_state import RequestState
from llmc.runtime.responses import RequestOutput, Response
from llmc.runtime.token_runs import TokenRuns
from llmc.runtime.types import (
    FinishReason,
    Request,
    RequestFault,
    ScheduledBatch,
    ScheduledSequence,
    Sequence,
    SequenceStatus,
)


class Finisher(Protocol):
    """The one Scheduler method post-processing needs (a stop string ends a sequence)."""

    def finish(self, request_id: int, reason: FinishReason, branch: int | None = None) -> Any: ...

    def stop_inside_window(self, seq: Sequence, num_outputs: int) -> None: ...


@dataclass
class InFlight:
    """A launched step and what its StepRecord needs."""

    batch: ScheduledBatch
    pending: Any  # PendingStep (async scheduling) or None
    start: float
    schedule_s: float
    used_blocks: int


def token_counts(batch: ScheduledBatch) -> tuple[int, int]:
    """(tokens, decode tokens) of ``batch`` in one pass over the rows that are not slot
    rows (``ScheduledSequence.is_decode``, inlined: this runs once per row per step)."""
    rows, seqs = batch.rows, batch.sequences
    if rows is not None and len(rows.slots) == len(seqs):  # decode rows only
        return len(rows.slots), len(rows.slots)
    pre = batch.prefix_rows  # a step with prompt chunks: its decode prefix at once
    total = decode = len(pre.seqs) if pre is not None else 0
    for s in seqs[total:] if total else seqs:
        n = s.num_new_tokens
        total += n
        if n == 1 and s.start_position >= len(s.seq.prompt_token_ids):
            decode += 1
    return total, decode


def stamp_scheduled(batch: ScheduledBatch, states: Mapping[int, RequestState], t0: float) -> None:
    """``t0`` := the first-scheduled time of the batch's requests that have none (decode
    rows over slots, ``rows`` / ``prefix_rows``, were all scheduled before)."""
    if batch.rows is not None:
        return
    pre = batch.prefix_rows
    seqs = batch.sequences
    for ss in seqs[len(pre.seqs) :] if pre is not None else seqs:
        rec = states[ss.seq.request_id].record
        if rec.scheduled_time is None:
            rec.scheduled_time = t0


def ahead_src_rows(prev: ScheduledBatch, ahead: ScheduledBatch) -> Seq[int] | None:
    """For each row of ``ahead`` (scheduled before ``prev``'s ids reached the host), the row
    of ``prev``'s sampled ids that is its input token, -1 for a row whose tokens the host
    knows (a prompt chunk, an admission: ``Scheduler.schedule_ahead``); ``range(n)`` when
    the rows are ``prev``'s, in order (the common case: no list of ``n`` ints per step),
    None when no row reads ``prev``'s ids."""
    pr, ar = prev.rows, ahead.rows
    if pr is not None and ar is not None and len(pr.seqs) == len(prev.sequences):
        # both over slots (every row of prev sampled): match the rows by slot
        if ar.seqs == pr.seqs:  # (list equality: identity, Sequence has no __eq__)
            return range(len(ar.seqs))
        idx = pr.index_of(ar.slots, ar.gens)
        if idx is not None:
            return idx.tolist()
    ahead_rows = ar if ar is not None else ahead.prefix_rows
    prev_rows = pr if pr is not None else prev.prefix_rows
    if ahead_rows is not None and prev_rows is not None:
        src = _src_over_slots(prev, prev_rows, ahead_rows, len(ahead.sequences))
        if src is not None:
            return src
    sampled = [ss.seq for ss in prev.sequences if ss.sample]
    rows = ahead.sequences
    if len(sampled) == len(rows) and all(map(ScheduledSequence.is_row_of, rows, sampled)):
        return range(len(rows))  # the common case: same sequences, same order
    index = {id(seq): i for i, seq in enumerate(sampled)}
    src = [index.get(id(ss.seq), -1) for ss in rows]
    return src if max(src, default=-1) >= 0 else None


def _src_over_slots(prev: ScheduledBatch, prev_rows: Any, rows: Any, n: int) -> Seq[int] | None:
    """``ahead_src_rows`` of an ``ahead`` batch of ``n`` rows whose slot rows ``rows`` (its
    ``rows`` or ``prefix_rows``) are every row it feeds from ``prev`` (what
    ``Scheduler.schedule_ahead`` makes), over the slots: ``prev``'s sampled row of each
    slot (its slot rows' at once, its other rows one by one); None when a slot row of either
    batch changed hands or is not one of ``prev``'s sampled rows (the caller matches rows by
    sequence instead)."""
    k = len(prev_rows.seqs)
    if not prev_rows.current(k):
        return None
    st = rows.state
    np = st._np
    row_of = np.full(st.capacity, -1, dtype=np.int64)  # prev's sampled row of each slot
    row_of[prev_rows.slots] = np.arange(k)
    j = k
    for ss in prev.sequences[k:]:
        if ss.sample:
            if ss.seq.slot >= 0:  # (a sequence finished since has no slot)
                row_of[ss.seq.slot] = j
            j += 1
    head = row_of[rows.slots]
    if bool((head < 0).any()) or not rows.current(len(rows.seqs)):
        return None
    if len(head) == n == j and bool((head == np.arange(n)).all()):
        return range(n)  # prev's sampled rows, in order
    return head.tolist() + [-1] * (n - len(head))


AHEAD_BUSY_ROWS = 64
"""``ahead_ok``'s default ``busy_rows``: from this many rows a step's device time exceeds the
host time of the launch ahead of its read, so the launch delays none of its ids."""


def ahead_ok(batch: ScheduledBatch, busy_rows: int = AHEAD_BUSY_ROWS) -> bool:
    """Whether the step after ``batch`` may be launched before ``batch``'s ids are read.

    No when a row is not plain sampling (``SamplingParams.is_plain``: penalties count the
    output tokens on the host, logprobs come back in their own copy). In a batch of fewer
    than ``busy_rows`` rows, also no when its ids are latency-critical or free a batch
    slot: a request's first token (a launch ahead of it could only delay it, by the
    launch's host time, or by a whole step where the launch waits for the device) or a
    request's last token by length (``Sequence.is_last_by_length``: a client that replaces
    a finished request, as a closed loop does, would otherwise wait for the speculative
    step before its prompt is scheduled). A busier step hides the launch's host time, and
    the step ahead admits waiting requests itself (``Scheduler.schedule_ahead``)."""
    if batch.window is not None:  # a window's rows stop on the device: the host decides
        return False
    seqs = batch.sequences
    busy = len(seqs) >= busy_rows
    rows, k = batch.rows, len(seqs)  # decode rows over slots: all of them, or a prefix
    if rows is None or not rows.current(k):
        rows = batch.prefix_rows
        k = len(rows.seqs) if rows is not None else 0
        if rows is None or not rows.current(k):
            rows, k = None, 0
    if rows is not None:
        st, slots = rows.state, rows.slots
        if not bool(st.plain[slots].all()):
            return False
        n_out = st.num_out[slots] + 1  # with this step's token
        if not busy and bool(((n_out == 1) | types.last_by_length(n_out, st.max_new[slots])).any()):
            return False
        if k == len(seqs):
            return True
    checked = None  # rows of one request share a params object: test it once per run
    for ss in seqs[k:] if k else seqs:
        seq = ss.seq
        p = seq.sampling
        if p is not checked:
            if not p.is_plain:
                return False
            checked = p
        if ss.sample and not busy:
            n_out = len(seq.output_token_ids) + 1  # with this step's token
            if n_out == 1 or seq.is_last_by_length(n_out):
                return False
    return True


def step_record(
    cur: InFlight, out: Any, update_start: float, end: float, kv_blocks_total: int
) -> StepRecord:
    """The StepRecord of ``cur``, computed as ``out``, updated from ``update_start`` to ``end``."""
    batch = cur.batch
    phases = {
        "schedule": cur.schedule_s,
        **dict(out.phase_times or {}),
        "update": end - update_start,
    }
    num_tokens, num_decode = token_counts(batch)
    steps = batch.window.num_steps if batch.window is not None else 1
    if steps > 1:  # a window: every row computed each of its steps (decode rows only)
        num_tokens = num_decode = num_tokens * steps
    return StepRecord(
        step_id=batch.step_id,
        start_time=cur.start,
        end_time=end,
        num_tokens=num_tokens,
        num_prefill_tokens=num_tokens - num_decode,
        num_decode_tokens=num_decode,
        batch_size=len(batch.sequences),
        kv_blocks_used=cur.used_blocks,
        kv_blocks_total=kv_blocks_total,
        num_preempted=len(batch.preempted_request_ids),
        phase_times=phases,
        num_steps=steps,
    )


def emit_step_responses(
    batch: ScheduledBatch,
    out: Any,
    now: float,
    states: Mapping[int, RequestState],
    scheduler: Finisher,
    emit: Callable[[Response], None],
    runs: TokenRuns | None = None,
) -> None:
    """Turn the tokens ``Scheduler.update`` appended for ``batch`` into Responses (``emit``).

    Call after the update, with the Executor's lock held. A request with several outputs
    routes each row to its output's state (``RequestState.output``); the other samples' first
    tokens come from the step's fork (``branch_steps``), a beam search's final Response when
    its group finished. With ``runs``, a step (or window) of decode rows over slots
    (``batch.rows``, or a step's ``prefix_rows``) without logprobs or forks keeps their
    deferred rows' token times in runs (runtime/token_runs.py) and passes only the other
    rows through the per-row loop."""
    prompt_lps = getattr(out, "prompt_logprobs", None)
    if prompt_lps:
        _store_prompt_logprobs(prompt_lps, states, scheduler, emit)
    logprobs = list(getattr(out, "logprobs", None) or [])
    forks = getattr(out, "branch_steps", None) or ()
    rows, pre = batch.rows, batch.prefix_rows
    if runs is not None and not logprobs and not prompt_lps and not forks:
        if rows is not None and len(rows.slots) == len(batch.sequences):
            seqs = rows.seqs
            k = batch.window.num_steps if batch.window is not None else 1
            rest = runs.step(rows, states, now, k)
            _emit_rows([seqs[i] for i in rest], [], now, states, scheduler, emit)
            return
        if pre is not None and batch.window is None:  # a step with prompt chunks
            seqs = pre.seqs  # (its first rows, each sampled: runs for them, the rest per row)
            rest = [seqs[i] for i in runs.step(pre, states, now, 1)]
            rest += [ss.seq for ss in batch.sequences[len(seqs) :] if ss.sample]
            _emit_rows(rest, [], now, states, scheduler, emit)
            return
    sampled = [ss.seq for ss in batch.sequences if ss.sample]
    _emit_rows(sampled, logprobs, now, states, scheduler, emit)
    for step in forks:
        _emit_fork(step, states, now, scheduler, emit)


def _emit_rows(
    seqs: list[Sequence],
    logprobs: list[Any],
    now: float,
    states: Mapping[int, RequestState],
    scheduler: Finisher,
    emit: Callable[[Response], None],
) -> None:
    """The per-row pass of ``emit_step_responses``: sampled rows ``seqs`` (with their
    ``logprobs``, or none)."""
    finished = SequenceStatus.FINISHED
    for row, seq in enumerate(seqs):
        state = states.get(seq.request_id)
        if state is None or state.final:  # ended (and maybe delivered) before this step
            continue
        logprob = logprobs[row] if logprobs else None
        try:
            if seq.group is not None:
                state = _group_row(seq, state, now, emit)
                if state is None:
                    continue
            if state.deferred and logprob is None and seq.status is not finished:
                # the common decode row, inline (no call per row): nothing to show until
                # the end, only the token's time (take_new_tokens)
                if state.run is not None:
                    state.settle()
                n = len(seq.output_token_ids)
                new = n - state.num_seen
                rec = state.record
                if new == 1:
                    rec.token_times.append(now)
                elif new:  # a multi-step window's burst
                    rec.token_times.extend([now] * new)
                else:
                    continue
                state.num_seen = n
                if rec.first_token_time is None:
                    rec.first_token_time = now
                continue
            _emit_row(seq, state, logprob, now, scheduler, emit)
        except Exception as e:  # this request's tokens broke post-processing: it alone fails
            _fail_row(state, scheduler, emit, "post-processing its tokens", e)


def _group_row(
    seq: Sequence, state: RequestState, now: float, emit: Callable[[Response], None]
) -> RequestState | None:
    """A sampled row of a request with several outputs: the output state that takes its
    token, or None when nothing is emitted per row (a beam: its request's step time, and
    its final Response once the search ended)."""
    if not seq.group.beam:
        out = state.output(seq)
        return None if out.done else out
    if seq.branch == 0:  # one token time per step for the whole search
        rec = state.record
        rec.token_times.append(now)
        if rec.first_token_time is None:
            rec.first_token_time = now
    if seq.status is SequenceStatus.FINISHED and not state.final:
        emit(state.beam_response(now))
    return None


def _emit_fork(
    step: Any,
    states: Mapping[int, RequestState],
    now: float,
    scheduler: Finisher,
    emit: Callable[[Response], None],
) -> None:
    """The first tokens of a sample fork's new outputs (beam steps emit nothing here)."""
    state = states.get(step.request_id)
    if state is None or state.final or state.seq is None or state.seq.group.beam:
        return
    children = state.seq.group.branches[1 : 1 + len(step.token_ids)]
    lps = step.logprobs or (None,) * len(children)
    for child, logprob in zip(children, lps, strict=True):
        out = state.output(child)
        try:
            _emit_row(child, out, logprob, now, scheduler, emit)
        except Exception as e:  # this request's tokens broke post-processing: it alone fails
            _fail_row(out, scheduler, emit, "post-processing its tokens", e)


def _store_prompt_logprobs(
    spans: list[Any],
    states: Mapping[int, RequestState],
    scheduler: Finisher,
    emit: Callable[[Response], None],
) -> None:
    """The step's prompt-logprob spans (``prompt_logprobs.PromptSpan``) into their requests'
    states; a request whose entries cannot be stored fails alone."""
    for span in spans:
        state = states.get(span.request_id)
        if state is None or state.final:
            continue
        try:
            state.add_prompt_logprobs(span.first, span.entries)
        except Exception as e:  # this request's entries only
            _fail_row(state, scheduler, emit, "storing its prompt logprobs", e)


def _fail_row(
    state: RequestState,
    scheduler: Finisher,
    emit: Callable[[Response], None],
    what: str,
    error: BaseException,
) -> None:
    """A request whose step post-processing raised: finished (its blocks freed) with an
    error Response (one output's failure fails its whole request)."""
    state = state.main or state
    seq = state.seq
    assert seq is not None
    if seq.status is not SequenceStatus.FINISHED:
        scheduler.finish(seq.request_id, FinishReason.ERROR)  # frees its blocks
    if not state.final:
        emit(state.error_response(RequestFault.caused(seq.request_id, what, error)))


def _emit_row(
    seq: Sequence,
    state: RequestState,
    logprob: Any,
    now: float,
    scheduler: Finisher,
    emit: Callable[[Response], None],
) -> None:
    """One sampled row of ``emit_step_responses`` that has something to show (not the inline
    deferred decode row): its timings, text delta, responses."""
    finished = SequenceStatus.FINISHED
    if len(seq.output_token_ids) - state.num_seen > 1 and state.has_stop_strings:
        delta = _window_text(seq, state, scheduler)  # a multi-step window's tokens
        new, new_lp = state.take_new_tokens(logprob, now)
        reason = seq.finish_reason if seq.status is finished else None
    else:
        new, new_lp = state.take_new_tokens(logprob, now)
        reason = seq.finish_reason if seq.status is finished else None
        text_ids = seq.output_token_ids[state.num_text :] if state.deferred else new
        # finished by update on this step's token: an EOS / stop token id (new[-1])
        stop_token = reason is not None and seq.stop_token_id is not None and new
        if stop_token:
            text_ids = text_ids[:-1]  # the EOS / stop token has no text in the output
        delta = state.detokenize(text_ids)
        if stop_token:
            state.num_text += 1
    if reason is None and state.stopped_by_string:  # the one stop decided here
        if seq.group is None:
            scheduler.finish(seq.request_id, FinishReason.STOP)
        else:  # one sample of several
            scheduler.finish(seq.request_id, FinishReason.STOP, seq.branch)
        reason = FinishReason.STOP
    if reason is not None:
        for response in state.finish(reason, new, delta, new_lp, now):
            emit(response)
    elif state.request.streaming and (new or delta):
        emit(state.delta_response(new, delta, new_lp))


def _window_text(seq: Sequence, state: RequestState, scheduler: Finisher) -> str:
    """The text delta of a window's new tokens for a request with stop strings, fed to the
    detokenizer one token at a time as single steps feed them. A stop string completed
    before the last new token ends the sequence there (``stop_inside_window`` discards the
    later tokens, which one step at a time would never have made)."""
    out = seq.output_token_ids
    # a finishing EOS / stop token id (the last token) has no text in the output
    stop_token = seq.status is SequenceStatus.FINISHED and seq.stop_token_id is not None
    end = len(out) - 1 if stop_token else len(out)
    delta = ""
    for i in range(state.num_seen, end):
        delta += state.detokenize(out[i : i + 1])
        if state.stopped_by_string:
            if i + 1 < len(out):
                scheduler.stop_inside_window(seq, i + 1)
            return delta
    if stop_token:
        state.num_text += 1
    return delta


def request_output(
    rid: int,
    prompt: Any,
    responses: list[Response],
    request: Request,
    seq: Sequence | None,
    record: RequestRecord,
) -> RequestOutput:
    """The RequestOutput of request ``rid`` from its Responses (the last one final)."""
    final = responses[-1]
    logprobs = [lp for r in responses if r.index == 0 for lp in (r.logprobs or [])]
    return RequestOutput(
        request_id=rid,
        prompt=prompt if isinstance(prompt, str) else request.prompt,
        prompt_token_ids=list(seq.prompt_token_ids) if seq is not None else [],
        token_ids=list(final.token_ids or []),
        text=final.text or "",
        finish_reason=final.finish_reason,
        error=final.error,
        error_code=final.error_code,
        logprobs=logprobs or None,
        record=record,
        prompt_logprobs=final.prompt_logprobs,
        cumulative_logprob=final.cumulative_logprob,
        completions=final.completions,
    )
