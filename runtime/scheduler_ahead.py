"""Async scheduling's step ahead (no torch): ``schedule_ahead`` schedules the next decode
step of the running sequences while the step in flight (``prev``) runs, before its sampled
tokens reach the host.

A mixin of ``Scheduler`` (runtime/scheduler.py, whose module docstring states the rules).
The rows are decided per row by ``_ahead_loop``, or over the slot arrays
(``runtime/slot_state.py``) by ``_ahead_over_slots`` when ``prev`` is a batch of slot rows
(``ScheduledBatch.rows``) and at least ``vector_rows`` sequences run: the same checks (each
running sequence is one of ``prev``'s rows, at the position ``prev`` computes, with a last
block of its own; a sequence whose ``prev`` token is its last by length is left out) and the
same new blocks, in the same order, as a few numpy operations; the objects are touched only
for the rows that start a new block. Either way the batch's rows are ``DecodeRows`` that are
``valid_ahead`` until ``prev``'s update and ``valid`` after it.
"""

from __future__ import annotations

import operator
from typing import Any

from llmc.runtime import types
from llmc.runtime.scheduler_slots import DecodeSlices, decode_slice, decode_slices
from llmc.runtime.slot_state import DecodeRows
from llmc.runtime.types import ScheduledBatch, ScheduledSequence, Sequence

_SLOT = operator.attrgetter("slot")


class AheadScheduling:
    """Scheduler methods of async scheduling's step ahead (see the module docstring)."""

    vector_rows: int
    limits: Any
    kv: Any
    slots: Any  # the scheduler's SlotState
    _running: list[Sequence]
    _waiting: dict[Any, Sequence]
    _step: int
    _num_tokens: int
    _peak_running: int
    # and Scheduler's _admit

    def schedule_ahead(self, prev: ScheduledBatch) -> ScheduledBatch | None:
        """The next step, scheduled while ``prev`` runs (async scheduling), or None.

        ``prev`` has been scheduled but not yet ``update``d: its sampled tokens are unknown,
        and each of its sampled sequences gets its next token computed from that unknown
        token (the runner takes it from the device). A sequence whose ``prev`` token is its
        last by length (``Sequence.is_last_by_length``) is left out; one that then stops on
        EOS / a stop token / a stop string has its extra token discarded by ``update``
        (it is no longer running) and its blocks were already freed by ``finish``.

        With no request waiting the step is those decode rows (``_ahead_over_slots`` /
        ``_ahead_loop``) when every running sequence is one of them; otherwise it is
        ``_ahead_mixed``'s: those rows first, then the next chunk of each running sequence
        that ``prev`` does not sample (its tokens are known: a prompt cut by the budget),
        then admissions of waiting sequences into the batch rows and blocks free now (the
        rows ``prev`` ends by length count as free). Returns None, and changes nothing,
        when there is no such step: a running sequence is not where ``prev`` leaves it or
        belongs to a request with several sequences, its next write may copy a block, too
        few blocks are free for the decode rows (no preemption here), or nothing is left.
        """
        running = self._running
        if not running and not self._waiting:
            return None
        if running and not self._waiting:
            over_slots = self._ahead_over_slots(prev)  # the same rows, decided over the slots
            if over_slots is not None:
                picked, rows = over_slots
            else:
                picked = self._ahead_loop(prev)
                rows = self._ahead_rows(picked)
            if picked:
                self._step += 1
                self._num_tokens += len(picked)
                seqs = picked if isinstance(picked, DecodeSlices) else tuple(picked)
                return ScheduledBatch(step_id=self._step - 1, sequences=seqs, rows=rows)
        return self._ahead_mixed(prev)

    def _ahead_loop(self, prev: ScheduledBatch) -> list[ScheduledSequence]:
        """``schedule_ahead``'s rows, one Python pass per row (their new blocks allocated);
        empty, with nothing changed, when there is no step ahead."""
        kv = self.kv
        tpb = kv.tokens_per_block
        running = self._running
        prev_rows = [ss for ss in prev.sequences if ss.sample]
        # the common case: prev sampled exactly the running sequences, in the same order
        if len(prev_rows) == len(running) and all(
            map(ScheduledSequence.is_row_of, prev_rows, running)
        ):
            pairs = zip(running, prev_rows, strict=True)
        else:
            sampled = {id(ss.seq): ss for ss in prev_rows}
            pairs = ((seq, sampled.get(id(seq))) for seq in running)
        picked: list[ScheduledSequence] = []
        grow: list[tuple[Sequence, int]] = []  # rows whose next token starts a new block
        need = 0
        for seq, ss in pairs:
            if ss is None or seq.num_computed_tokens != ss.start_position:
                return []
            if seq.shares_last_block:  # its next write may copy a block: the host decides
                return []
            if seq.is_last_by_length(len(seq.output_token_ids) + 1):  # prev's token ends it
                continue
            n_prev = ss.num_new_tokens
            start = ss.start_position + n_prev
            if start >= len(seq.block_table) * tpb:
                need += kv.num_blocks_needed(seq, n_prev + 1)  # a new block
                grow.append((seq, n_prev))
            picked.append(decode_slice(seq, start))
        if not picked or len(picked) > self.limits.max_num_tokens or need > kv.num_free_blocks:
            return []
        for seq, n_prev in grow:
            if not kv.append_slots(seq, n_prev + 1):
                raise RuntimeError(f"request {seq.request_id}: block count was wrong (bug)")
            self.slots.write(seq)
        return picked

    def _ahead_over_slots(
        self, prev: ScheduledBatch
    ) -> tuple[list[ScheduledSequence], DecodeRows | None] | None:
        """``_ahead_loop``'s rows (empty: no step ahead, nothing changed) and their slot rows,
        decided over the slot arrays; None, with nothing changed, when ``prev`` has no slot
        rows of all its rows, few sequences run, or a running sequence is not one of them
        as it was (the loop then decides)."""
        pr = prev.rows
        running = self._running
        n = len(running)
        if pr is None or n < self.vector_rows or len(pr.seqs) != len(prev.sequences):
            return None
        st = self.slots
        np = st._np
        if running == pr.seqs:  # the same sequences in the same order (identity)
            slots, prev_start = pr.slots, pr.start
            if not bool((st.gen[slots] == pr.gens).all()):
                return None
        else:  # some of prev's rows stopped: find each running sequence's row by its slot
            slots = np.fromiter(map(_SLOT, running), dtype=np.int64, count=n)
            if int(slots.min()) < 0:
                return None
            idx = pr.index_of(slots, st.gen[slots])
            if idx is None:
                return None
            prev_start = pr.start[idx]
        if not bool((st.computed[slots] == prev_start).all()) or bool(st.shares[slots].any()):
            return [], None  # a row is not where prev computes, or its next write may copy
        keep = ~types.last_by_length(st.num_out[slots] + 1, st.max_new[slots])  # prev's ends it
        if bool(keep.all()):
            seqs, start = running[:], prev_start + 1  # (a copy: the list changes)
        else:
            k = np.flatnonzero(keep)
            seqs, slots, start = [running[i] for i in k.tolist()], slots[k], prev_start[k] + 1
        b = len(seqs)
        if not b or b > self.limits.max_num_tokens:
            return [], None
        tpb = self.kv.tokens_per_block
        blocks = st.blocks[slots]
        # the blocks for two more tokens after computed = start - 1 (kv.num_blocks_needed)
        if int(np.maximum((start + tpb) // tpb - blocks, 0).sum()) > self.kv.num_free_blocks:
            return [], None
        grow = np.flatnonzero(start >= blocks * tpb)  # the rows whose token starts a block
        if not st.append_blocks(self.kv, seqs, slots, grow, start + 1):
            for i in grow.tolist():
                if not self.kv.append_slots(seqs[i], 2):
                    raise RuntimeError(f"request {seqs[i].request_id}: block count was wrong")
                st.write_table(seqs[i])  # (no row shares its last block: checked above)
        rows = DecodeRows(seqs, slots, start, st) if b >= self.vector_rows else None
        if rows is None:
            return decode_slices(seqs, start.tolist()), None
        return DecodeSlices(seqs, start), rows

    def _ahead_mixed(self, prev: ScheduledBatch) -> ScheduledBatch | None:
        """``schedule_ahead``'s step when it is not decode rows alone (see there): decided
        over the slot arrays, with one Python pass over ``prev``'s rows that are not slot
        rows, the running sequences ``prev`` does not sample and the admissions."""
        if prev.branching or prev.window is not None:
            return None
        running = self._running
        st = self.slots
        np = st._np
        n = len(running)
        slots = np.fromiter(map(_SLOT, running), dtype=np.int64, count=n)
        if n and (int(slots.min()) < 0 or bool((st.grouped[slots] | st.shares[slots]).any())):
            return None
        prev_n, prev_start = self._prev_rows_by_slot(prev)
        computed = st.computed[slots]
        n_prev = prev_n[slots]
        if bool(((n_prev > 0) & (prev_start[slots] != computed)).any()):
            return None  # a row is not where prev computes (stale)
        start = computed + n_prev
        num_out = st.num_out[slots]
        left = st.prompt_len[slots] + num_out - start  # known tokens prev leaves uncomputed
        fed = left == 0  # prev samples its next token: a decode row fed from the device
        keep = fed & ~types.last_by_length(num_out + 1, st.max_new[slots])
        leaving = int(fed.sum()) - int(keep.sum())
        cfg, kv, tpb = self.limits, self.kv, self.kv.tokens_per_block
        if bool(keep.all()):
            d_seqs, d_slots, d_start, d_prior = running[:], slots, start, computed
        else:
            k = np.flatnonzero(keep)
            d_seqs, d_slots, d_start = [running[i] for i in k.tolist()], slots[k], start[k]
            d_prior = computed[k]
        budget = cfg.max_num_tokens - len(d_seqs)
        if budget < 0:
            return None
        # the decode rows' blocks first: one new block where the row's token starts one
        grow = np.flatnonzero(d_start >= st.blocks[d_slots] * tpb)
        if len(grow) > kv.num_free_blocks:
            return None
        if not st.append_blocks(kv, d_seqs, d_slots, grow, d_start + 1):
            for i in grow.tolist():
                seq = d_seqs[i]
                if not kv.append_slots(seq, int(d_start[i]) + 1 - seq.num_computed_tokens):
                    raise RuntimeError(f"request {seq.request_id}: block count was wrong (bug)")
                st.write_table(seq)
        # then the next chunk of each running sequence prev does not sample, in queue order
        decode: list[ScheduledSequence] = []
        chunks: list[ScheduledSequence] = []
        room = True
        for i in np.flatnonzero(~fed).tolist():
            if budget <= 0:
                break
            seq, a = running[i], int(start[i])
            m = min(int(left[i]), budget)
            if not kv.append_slots(seq, a + m - seq.num_computed_tokens):
                room = False  # (no preemption ahead: the next synchronous step decides)
                break
            st.write_table(seq)
            ss = ScheduledSequence(seq, a, m, m == int(left[i]))
            (decode if m == 1 and a >= len(seq.prompt_token_ids) else chunks).append(ss)
            budget -= m
        admitted: list[ScheduledSequence] = []
        if room and self._waiting:
            filling = kv.filling_hashes(s for s in self._prev_tail(prev) if s.num_new_tokens > 1)
            budget, _ = self._admit(budget, n - leaving, admitted, ahead=True, filling=filling)
        if not d_seqs and not decode and not chunks and not admitted:
            return None
        self._step += 1
        self._num_tokens += cfg.max_num_tokens - budget
        self._peak_running = max(self._peak_running, len(running))
        pre = None
        if len(d_seqs) >= self.vector_rows:
            pre = DecodeRows(d_seqs, d_slots, d_start, st, prior=d_prior)
        step = self._step - 1
        if not (decode or chunks or admitted):
            if pre is None:
                return ScheduledBatch(step, tuple(decode_slices(d_seqs, d_start.tolist())))
            return ScheduledBatch(step, DecodeSlices(d_seqs, d_start), rows=pre)  # type: ignore[arg-type]
        rows = decode_slices(d_seqs, d_start.tolist()) + decode
        for ss in admitted:  # ScheduledSequence.is_decode (a re-admitted one may decode)
            (rows if ss.is_decode else chunks).append(ss)
        return ScheduledBatch(
            step,
            tuple(rows + chunks),
            block_copies=kv.take_copies(),
            prefix_rows=pre,
        )

    @staticmethod
    def _prev_tail(prev: ScheduledBatch) -> Any:
        """``prev``'s rows after its slot rows (its prompt chunks are among them)."""
        pr = prev.rows if prev.rows is not None else prev.prefix_rows
        k = len(pr.seqs) if pr is not None else 0
        return prev.sequences[k:]

    def _prev_rows_by_slot(self, prev: ScheduledBatch) -> tuple[Any, Any]:
        """([capacity] new tokens, [capacity] start position) of each slot's row in
        ``prev`` (0 and -1 where the slot's sequence has none): its slot rows at once, its
        other rows one by one (those of sequences still running)."""
        st = self.slots
        np = st._np
        n_new = np.zeros(st.capacity, dtype=np.int64)
        start = np.full(st.capacity, -1, dtype=np.int64)
        pr = prev.rows if prev.rows is not None else prev.prefix_rows
        k = 0
        if pr is not None and pr.current(len(pr.seqs)):
            k = len(pr.seqs)
            n_new[pr.slots] = 1
            start[pr.slots] = pr.start
        if k < len(prev.sequences):
            running = types.SequenceStatus.RUNNING
            for ss in prev.sequences[k:]:
                seq = ss.seq
                if seq.status is running and seq.slot >= 0:
                    n_new[seq.slot] = ss.num_new_tokens
                    start[seq.slot] = ss.start_position
        return n_new, start

    def _ahead_rows(self, picked: list[ScheduledSequence]) -> DecodeRows | None:
        """The slot rows of a batch scheduled ahead (``schedule_ahead``: decode rows whose
        positions follow the step in flight), None when it is small or has branches; they
        are ``valid_ahead`` until that step's update and ``valid`` after it."""
        if len(picked) < self.vector_rows:
            return None
        np = self.slots._np
        seqs = [ss.seq for ss in picked]
        slots = np.fromiter(map(_SLOT, seqs), dtype=np.int64, count=len(seqs))
        if slots.min() < 0 or self.slots.grouped[slots].any():
            return None
        start = np.fromiter((ss.start_position for ss in picked), np.int64, len(picked))
        return DecodeRows(seqs, slots, start, self.slots)
