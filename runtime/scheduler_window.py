"""The Scheduler's multi-step decoding (no torch): K decode steps per host iteration.

A mixin of ``Scheduler`` (runtime/scheduler.py, whose module docstring states the rules),
as vLLM's multi-step scheduling and TensorRT-LLM's on-device loop: ``plan_window`` turns the
decode-only batch ``schedule()`` just made into a ``DecodeWindow`` batch (or returns it as it
is); the runner then computes K decode steps with each sampled token fed back on the device;
``update_window`` applies the window's tokens at catch-up; ``stop_inside_window`` applies a
stop string the detokenizer found inside a window.

A batch becomes a window only when all of these hold (else it stays one step):
- every running sequence is in it as a decode row (one new token past the prompt, sampled):
  no prefill chunk, no sequence the budget skipped, no preemption or block copy this step;
- no sequence waits while a batch slot is free (admissions interleave at iteration
  boundaries, so an arrival waits at most one window for its first chunk);
- every row is plain (``SamplingParams.is_plain``: no logprobs, penalties, min_tokens, beams,
  n / best_of forks), has at most ``MAX_WINDOW_STOP_IDS`` stop ids and owns its last block.

K = min(``max_steps``, the most tokens a row may still make), halved until every row's
blocks for its next ``min(K, tokens it may still make)`` tokens fit in the free pool (below
two: one step). Under guaranteed_no_evict those blocks are within each row's reservation.

Invariants: ``update_window`` accepts a row's tokens in order up to its first stop, each
decided by ``_token_stop`` exactly as ``update`` decides a single step's token, so the tokens
equal those of K single steps; the window's later tokens of a stopped row are discarded and
its blocks (the reserved ones included) are freed at once.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from llmc.runtime.types import (
    MAX_WINDOW_STOP_IDS,
    DecodeWindow,
    FinishReason,
    ScheduledBatch,
    Sequence,
    SequenceStatus,
)

_SEQ = operator.attrgetter("seq")
_START = operator.attrgetter("start_position")
_NEW = operator.attrgetter("num_new_tokens")
_SAMPLE = operator.attrgetter("sample")
_GROUP = operator.attrgetter("group")
_SHARES = operator.attrgetter("shares_last_block")
_PARAMS = operator.attrgetter("sampling")
_PROMPT = operator.attrgetter("prompt_token_ids")
_TABLE = operator.attrgetter("block_table")
_MAX_NEW = operator.attrgetter("max_new_tokens")
_OUT = operator.attrgetter("output_token_ids")


def tokens_left(seqs: list[Sequence]) -> Any:
    """[b] int64 numpy array: the tokens each sequence may still make (``max_new_tokens`` -
    outputs)."""
    import numpy as np  # lazily: the CLI imports the scheduler, ``llmc --version`` no numpy

    b = len(seqs)
    most = np.fromiter(map(_MAX_NEW, seqs), dtype=np.int64, count=b)
    return most - np.fromiter(map(len, map(_OUT, seqs)), dtype=np.int64, count=b)


class WindowScheduling:
    """Scheduler methods of multi-step decoding (see the module docstring)."""

    _running: list[Sequence]
    _waiting: dict
    _eos: frozenset[int]
    _num_tokens: int
    kv: Any
    limits: Any
    slots: Any  # the scheduler's SlotState
    # and Scheduler's _stop_ids / _finish, BranchScheduling's _token_stop,
    # SlotScheduling's _update_window_rows

    def plan_window(self, batch: ScheduledBatch, max_steps: int) -> ScheduledBatch:
        """``batch`` (just scheduled) as a window of up to ``max_steps`` decode steps with
        their KV blocks allocated, or ``batch`` unchanged when it must stay one step."""
        running = self._running
        rows = batch.sequences
        if (
            max_steps < 2
            or batch.preempted_request_ids
            or batch.block_copies
            or batch.branching
            or len(rows) != len(running)
            or (self._waiting and len(running) < self.limits.max_batch_size)
        ):
            return batch
        b = len(rows)
        slot_rows = batch.rows
        if slot_rows is not None and slot_rows.valid(b):  # decode rows over the slot arrays
            st, slots = slot_rows.state, slot_rows.slots
            if (
                st.grouped[slots].any()
                or st.shares[slots].any()
                or not st.plain[slots].all()
                or st.many_stops[slots].any()  # more than MAX_WINDOW_STOP_IDS
            ):
                return batch
            seqs, start = slot_rows.seqs, slot_rows.start
            left = st.max_new[slots] - st.num_out[slots]
            have = st.blocks[slots]
        else:
            found = self._window_rows(rows)
            if found is None:
                return batch
            seqs, start, left, have = found
        k = min(max_steps, int(left.max()))
        import numpy as np  # lazily (see tokens_left)

        tpb, free = self.kv.tokens_per_block, self.kv.num_free_blocks
        while k >= 2:
            grow = np.maximum(0, -(-(start + np.minimum(k, left)) // tpb) - have)
            if int(grow.sum()) <= free:
                break
            k //= 2
        if k < 2:
            return batch
        for i in np.flatnonzero(grow).tolist():
            if not self.kv.append_slots(seqs[i], min(k, int(left[i]))):
                raise RuntimeError(f"request {seqs[i].request_id}: block count was wrong (bug)")
            self.slots.write(seqs[i])
        self._num_tokens += (k - 1) * len(rows)
        return dataclasses.replace(batch, window=DecodeWindow(k, self._eos))

    def _window_rows(self, rows: Any) -> tuple[list[Sequence], Any, Any, Any] | None:
        """(sequences, starts, tokens left, blocks held) of ``rows`` read from the objects,
        or None when a row cannot be in a window (see the module docstring)."""
        seqs = list(map(_SEQ, rows))
        if (
            any(map(_GROUP, seqs))
            or any(map(_SHARES, seqs))
            or not all(map(_SAMPLE, rows))
            or any(n != 1 for n in map(_NEW, rows))
        ):
            return None
        params = dict(zip(map(id, map(_PARAMS, seqs)), map(_PARAMS, seqs), strict=True))
        if not all(
            p.is_plain and len(self._stop_ids(p)) <= MAX_WINDOW_STOP_IDS for p in params.values()
        ):
            return None
        import numpy as np  # lazily (see tokens_left)

        b = len(rows)
        start = np.fromiter(map(_START, rows), dtype=np.int64, count=b)
        if (start < np.fromiter(map(len, map(_PROMPT, seqs)), dtype=np.int64, count=b)).any():
            return None  # a re-prefill of outputs after preemption is not a decode row
        have = np.fromiter(map(len, map(_TABLE, seqs)), dtype=np.int64, count=b)
        return seqs, start, tokens_left(seqs), have

    def update_window(self, batch: ScheduledBatch, row_tokens: list[list[int]]) -> list[Sequence]:
        """Apply a computed window: ``row_tokens[i]`` are the tokens row ``i`` of ``batch``
        made (the device stopped it after its stop id or its last token by length). Returns
        the sequences that finished; see the module docstring for the rule."""
        rows = batch.sequences
        window = batch.window
        if window is None or len(row_tokens) != len(rows):
            raise ValueError(
                f"step {batch.step_id}: update_window takes a window batch and one token list "
                f"per row ({len(rows)}), got {len(row_tokens)}"
            )
        k = window.num_steps
        done = self._update_window_rows(batch, row_tokens, k)  # over the slots, when it can
        if done is not None:
            return done
        running = SequenceStatus.RUNNING
        finished: list[Sequence] = []
        for ss, toks in zip(rows, row_tokens, strict=True):
            if ss.seq.status is not running:
                continue  # finished (cancelled) between plan_window() and now
            if self._window_row(batch.step_id, ss, toks, k):
                finished.append(ss.seq)
        return finished

    def _window_row(self, step_id: int, ss: Any, toks: list[int], k: int) -> bool:
        """Apply the window's tokens ``toks`` of row ``ss`` (a running sequence's); True
        when they finished it."""
        seq = ss.seq
        before = seq.num_computed_tokens
        if before != ss.start_position:
            raise RuntimeError(
                f"request {seq.request_id}: step {step_id} is stale (computed "
                f"{before} tokens, step started at {ss.start_position})"
            )
        stops = self._stop_ids(seq.sampling)
        out = seq.output_token_ids
        reason = None
        if stops.isdisjoint(toks) and len(out) + len(toks) < seq.max_new_tokens:
            out.extend(toks)  # the common row: no stop inside the window
            n = len(toks)
        else:
            n = 0
            for token in toks:
                out.append(token)
                n += 1
                reason = self._token_stop(seq, token, stops)
                if reason is not None:
                    break
        if reason is None and n != k:
            raise RuntimeError(
                f"request {seq.request_id}: step {step_id} made {n} of {k} tokens "
                "without a stop (runner bug)"
            )
        after = seq.num_computed_tokens = before + n
        self.slots.write(seq)
        tpb = self.kv.tokens_per_block
        if self.kv.enable_block_reuse and after // tpb != before // tpb:  # a block filled up
            self.kv.register_full_blocks(seq)
        if reason is None:
            return False
        self._running.remove(seq)
        self._finish(seq, reason)
        return True

    def stop_inside_window(self, seq: Sequence, num_outputs: int) -> None:
        """A stop string ended ``seq`` at output token ``num_outputs`` of a window: the
        window's later tokens are discarded (one step at a time would never have made them)
        and it finishes with STOP (its blocks freed), whatever stop ``update_window``
        decided for a later token."""
        del seq.output_token_ids[num_outputs:]
        seq.stop_token_id = None
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self._finish(seq, FinishReason.STOP)
        else:
            seq.finish_reason = FinishReason.STOP
