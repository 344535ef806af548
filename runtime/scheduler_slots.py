"""The Scheduler's decode rows over the slot arrays (no torch): ``schedule`` and ``update``
of decode rows as a few numpy operations over their slots (``runtime/slot_state.py``)
instead of a Python pass per row.

A mixin of ``Scheduler`` (runtime/scheduler.py, whose module docstring states the rules):
``_decode_prefix`` makes the decode rows of the running list's longest prefix whose next
step is one decode token (with a new block where it starts one), exactly the rows and
blocks the per-row loop of ``schedule`` would make of them; ``_update_rows`` (a step) and
``_update_window_rows`` (a multi-step window) apply a batch of such rows, with the stop
decision of the per-row loops (``_token_stop``, ``_window_row``) for the rows whose tokens
may stop them (a stop id, the last by length, more stop ids than the table holds), so the
tokens and stops are those of the loops. They change the arrays and the Sequence objects
together; ``check_slots`` compares them.

Batches of fewer than ``vector_rows`` rows take the per-row loops (numpy's cost per call
exceeds theirs).
"""

from __future__ import annotations

import itertools
import operator
from collections import abc, deque
from collections.abc import Iterator
from typing import Any

from llmc.runtime import types
from llmc.runtime.slot_state import DecodeRows
from llmc.runtime.types import ScheduledBatch, ScheduledSequence, Sequence

_tuple_new = tuple.__new__
_SLOT = operator.attrgetter("slot")
_OUT = operator.attrgetter("output_token_ids")


def decode_slice(seq: Sequence, start: int) -> ScheduledSequence:
    """``ScheduledSequence(seq, start, 1, True)``: one decode row."""
    return _tuple_new(ScheduledSequence, (seq, start, 1, True))


def decode_slices(seqs: list[Sequence], starts: list[int]) -> list[ScheduledSequence]:
    """The decode rows ``ScheduledSequence(seqs[i], starts[i], 1, True)``, built at C speed
    (``tuple.__new__`` mapped over the fields: one per decode row per step)."""
    rep = itertools.repeat
    fields = zip(seqs, starts, rep(1), rep(True), strict=False)  # (the repeats are endless)
    return list(map(_tuple_new, rep(ScheduledSequence), fields))


class DecodeSlices(abc.Sequence):
    """``ScheduledBatch.sequences`` of decode rows over slots, built when first read: it
    reads as the tuple ``decode_slices(seqs, starts)`` (iteration, indexing, equality with
    a tuple), and its rows are made by the first read that needs them; ``len`` and truth
    need none. A steady decode step reads its rows' slot arrays (``ScheduledBatch.rows``)
    instead, so its ``ScheduledSequence`` objects are never made."""

    __slots__ = ("_seqs", "_starts", "_rows")

    def __init__(self, seqs: list[Sequence], starts: Any) -> None:
        self._seqs, self._starts = seqs, starts
        self._rows: tuple[ScheduledSequence, ...] | None = None

    def rows(self) -> tuple[ScheduledSequence, ...]:
        """The rows as a tuple (made on the first call)."""
        if self._rows is None:
            self._rows = tuple(decode_slices(self._seqs, self._starts.tolist()))
        return self._rows

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i: Any) -> Any:
        return self.rows()[i]

    def __iter__(self) -> Iterator[ScheduledSequence]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DecodeSlices):
            other = other.rows()
        return isinstance(other, tuple) and self.rows() == other

    __hash__ = None  # type: ignore[assignment]  # (as a list: equal to a tuple, unhashable)

    def __repr__(self) -> str:
        return repr(self.rows())


class SlotScheduling:
    """Scheduler methods over the slot arrays (see the module docstring)."""

    vector_rows = 8
    """Rows from which a batch takes the vectorised paths (a class attribute: tests set it)."""
    _running: list[Sequence]
    kv: Any
    slots: Any  # the scheduler's SlotState
    # and Scheduler's _stop_ids / _finish, BranchScheduling's _token_stop,
    # WindowScheduling's _window_row

    def _decode_prefix(
        self, budget: int
    ) -> tuple[DecodeSlices | list[ScheduledSequence], DecodeRows | None]:
        """The decode rows of the longest prefix of the running list (at most ``budget``)
        whose next step is one token past the prompt, in a block of its own (it gets a new
        one when its token starts one), of a sequence with no other branches: what the
        per-row loop of ``schedule`` would make of them (the same blocks, in the same
        order), decided over their slots' arrays (``SlotState``) at once."""
        running = self._running
        n = min(len(running), budget)
        if n < self.vector_rows:
            return [], None
        np = self.slots._np
        st = self.slots
        slots = np.fromiter(map(_SLOT, running), dtype=np.int64, count=len(running))[:n]
        computed = st.computed[slots]
        prompt = st.prompt_len[slots]
        fast = (
            (prompt + st.num_out[slots] - computed == 1)
            & (computed >= prompt)
            & ~st.shares[slots]
            & ~st.grouped[slots]
        )
        k = n if fast.all() else int(np.argmin(fast))  # the first row that is not
        # rows whose token starts a new block get it, in order, as the loop gives it; the
        # first that finds no free block ends the prefix (the loop preempts for it)
        grow = np.flatnonzero(computed[:k] >= st.blocks[slots[:k]] * self.kv.tokens_per_block)
        if not st.append_blocks(self.kv, running, slots, grow, computed + 1):
            for i in grow.tolist():
                if not self.kv.append_slots(running[i], 1):
                    k = i
                    break
                st.write_table(running[i])  # (its last block is its own: ``fast``)
        seqs = running[:k]
        start = computed[:k]
        return DecodeSlices(seqs, start), DecodeRows(seqs, slots[:k], start, st)

    def _update_rows(self, batch: ScheduledBatch, token_ids: Any) -> list[Sequence] | None:
        """``update`` of a batch of decode rows over their slots (``ScheduledBatch.rows``):
        the same changes and stop decisions as the per-row loop, which only the rows whose
        token may stop them (a stop id, the last by length) still take. None, with nothing
        changed, for any other batch (the loop then applies it, or raises what it raises)."""
        rows = batch.rows
        b = len(batch.sequences)
        if rows is None or len(token_ids) != b or not rows.valid(b):
            return None  # no slot rows, or a row stopped running (or went stale) since
        return self._apply_rows(rows, token_ids)

    def _prefix_current(self, seqs: Any, rows: DecodeRows) -> bool:
        """Whether ``rows`` (``ScheduledBatch.prefix_rows``: the first rows of ``seqs`` by its
        contract, as ``rows`` are all of them) are still ``valid``: every slot holds its
        sequence at the scheduled position."""
        k = len(rows.seqs)
        return len(seqs) >= k and rows.valid(k)

    def _apply_rows(self, rows: DecodeRows, token_ids: Any) -> list[Sequence]:
        """``update`` of valid decode rows over their slots with one token each (see
        ``_update_rows``); the sequences it finished."""
        b = len(rows.seqs)
        np = self.slots._np
        st = self.slots
        slots, seqs, before = rows.slots, rows.seqs, rows.start
        after = before + 1
        toks = np.asarray(token_ids, dtype=np.int64).reshape(b)
        st.computed[slots] = after
        st.num_out[slots] += 1
        st.last[slots] = toks
        deque(map(setattr, seqs, itertools.repeat("num_computed_tokens"), after.tolist()), 0)
        deque(map(list.append, map(_OUT, seqs), toks.tolist()), 0)
        tpb = self.kv.tokens_per_block
        if self.kv.enable_block_reuse:  # the rows where a block filled up in this step
            filled = np.flatnonzero(after % tpb == 0).tolist()
            if filled:
                self.kv.register_filled_blocks([seqs[i] for i in filled])
        maybe = (
            (st.stops[slots, : st.stop_cols] == toks[:, None]).any(axis=1)
            | types.last_by_length(st.num_out[slots], st.max_new[slots])
            | st.many_stops[slots]
        )
        finished: list[Sequence] = []
        for i in np.flatnonzero(maybe).tolist():
            seq = seqs[i]
            reason = self._token_stop(seq, int(toks[i]), self._stop_ids(seq.sampling))
            if reason is not None:
                self._running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _update_window_rows(
        self, batch: ScheduledBatch, row_tokens: list[list[int]], k: int
    ) -> list[Sequence] | None:
        """``update_window`` of a window of decode rows over their slots (``ScheduledBatch.
        rows``): the rows that made all ``k`` tokens with none that may stop them (a stop
        id, the last by length) are applied at once; the others by ``_window_row``, the
        per-row rule. None, with nothing changed, when the batch has no valid slot rows."""
        rows = batch.rows
        b = len(batch.sequences)
        if rows is None or not rows.valid(b):
            return None
        np = self.slots._np
        st = self.slots
        slots, seqs, before = rows.slots, rows.seqs, rows.start
        if sum(map(len, row_tokens)) == b * k:  # every row made all k tokens
            full = np.ones(b, dtype=bool)
            flat = itertools.chain.from_iterable(row_tokens)
            toks = np.fromiter(flat, dtype=np.int64, count=b * k).reshape(b, k)
        else:
            full = np.fromiter(map(len, row_tokens), dtype=np.int64, count=b) == k
            toks = np.full((b, k), -1, dtype=np.int64)
            for i in np.flatnonzero(full).tolist():
                toks[i] = row_tokens[i]
        maybe = (
            ~full
            | (st.stops[slots, None, : st.stop_cols] == toks[:, :, None]).any(axis=(1, 2))
            | types.last_by_length(st.num_out[slots] + k, st.max_new[slots])
            | st.many_stops[slots]
        )
        common = np.flatnonzero(~maybe)
        cs = slots[common]
        after = before[common] + k
        st.computed[cs] = after
        st.num_out[cs] += k
        st.last[cs] = toks[common, -1]
        if len(common) < b:
            picked = [seqs[i] for i in common.tolist()]
            made = [row_tokens[i] for i in common.tolist()]
        else:
            picked, made = seqs, row_tokens
        deque(map(setattr, picked, itertools.repeat("num_computed_tokens"), after.tolist()), 0)
        deque(map(list.extend, map(_OUT, picked), made), 0)
        tpb = self.kv.tokens_per_block
        if self.kv.enable_block_reuse:  # the rows where a block filled up in the window
            for i in np.flatnonzero(after // tpb != before[common] // tpb).tolist():
                self.kv.register_full_blocks(picked[i])
        finished: list[Sequence] = []
        ss_rows = batch.sequences
        for i in np.flatnonzero(maybe).tolist():
            if self._window_row(batch.step_id, ss_rows[i], row_tokens[i], k):
                finished.append(seqs[i])
        return finished

    def check_slots(self) -> list[str]:
        """Every difference between the slot arrays and the running sequences (empty when
        the mirror holds; the mirror tests call it after every step)."""
        return self.slots.mismatches(self._running, lambda s: self._stop_ids(s.sampling))
