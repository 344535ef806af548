"""Running sequences' per-step state as numpy arrays indexed by a slot (no torch).

One slot per running sequence: ``SlotState.assign`` gives it one when it starts running
(admission, a fork's new branch), ``release`` takes it back when it stops (finish,
preemption); ``Sequence.slot`` is the index (-1 while not running). Row ``Sequence.slot``
of every array mirrors the fields of that sequence which the scheduler's decode rows read or
write every step, so ``Scheduler.schedule`` and ``Scheduler.update`` work on a decode batch
with a few numpy operations over its rows' slots instead of one Python pass per row:

- ``computed``: ``num_computed_tokens``; ``num_out``: ``len(output_token_ids)``;
  ``prompt_len``: ``len(prompt_token_ids)``; ``max_new``: ``max_new_tokens``;
- ``blocks``: ``len(block_table)``; ``table`` [capacity, ``width``] int32: its entries
  (-1 beyond), copied as ``Sequence.block_table_version`` says (only the appended blocks
  when no reset happened since the last copy); ``shares``: ``shares_last_block``;
- ``last``: its last known token id (the input of its next decode step);
- ``grouped``: the sequence belongs to a request with several (``Sequence.group``);
  ``plain``: ``sampling.is_plain``;
- ``gen``: bumped whenever the slot is assigned or released, so a ``DecodeRows`` taken
  earlier tells whether its slots still hold its sequences;
- ``min_tokens``: ``sampling.min_tokens``; ``stops`` [capacity, ``stop_width``]: the ids
  that stop it (``types.stop_ids``), padded with -1 (only the first ``stop_cols`` columns
  were ever used); ``many_stops``: more ids than
  ``stop_width`` (its stop check is the scalar one every step).

The Sequence objects stay the API's state (RequestState, responses, the KV manager read
them); the scheduler keeps both equal: its vectorised paths write the arrays and the
objects together, every other change of a running sequence is followed by ``write``.
``mismatches`` compares them (the mirror tests call it after every step).
"""

from __future__ import annotations

from typing import Any

from llmc.runtime.types import MAX_WINDOW_STOP_IDS, Sequence

_INT_FIELDS = (
    "computed",
    "num_out",
    "prompt_len",
    "max_new",
    "blocks",
    "min_tokens",
    "last",
    "gen",
    "table_version",
)
_BOOL_FIELDS = ("shares", "grouped", "many_stops", "plain")


class DecodeRows:
    """A decode-only batch's rows as slots (``ScheduledBatch.rows``, made by the scheduler):
    row ``i`` computes the token at position ``start[i]`` of ``seqs[i]`` (its one new token,
    sampled), which runs in slot ``slots[i]`` of ``state``. The arrays are read while the
    slots still hold the rows' sequences (``valid``)."""

    __slots__ = ("seqs", "slots", "gens", "start", "state", "prior")

    def __init__(
        self, seqs: list[Sequence], slots: Any, start: Any, state: SlotState, prior: Any = None
    ) -> None:
        """``prior`` (a batch scheduled ahead): each row's computed tokens when it was
        scheduled, before the step in flight computes the rest (None: ``start - 1``, that
        step's one decode token)."""
        self.seqs, self.slots, self.start, self.state = seqs, slots, start, state
        self.gens = state.gen[slots]
        self.prior = prior

    def index_of(self, slots: Any, gens: Any) -> Any:
        """The row [n] int64 of each of ``slots`` among these rows; None when one is not
        among them or its row's generation is not ``gens`` (the slot changed hands)."""
        st = self.state
        inv = st._np.full(st.capacity, -1, dtype=st._np.int64)
        inv[self.slots] = st._np.arange(len(self.slots))
        idx = inv[slots]
        if bool((idx < 0).any()) or not bool((self.gens[idx] == gens).all()):
            return None
        return idx

    def current(self, num_rows: int) -> bool:
        """Whether these are the ``num_rows`` rows of a batch and every slot still holds its
        sequence (none finished or was preempted since), whatever it computed since."""
        return len(self.slots) == num_rows and bool((self.state.gen[self.slots] == self.gens).all())

    def valid(self, num_rows: int) -> bool:
        """Whether these are the ``num_rows`` rows of a batch and every slot still holds its
        sequence at the position it was scheduled at."""
        return self.current(num_rows) and bool(
            (self.state.computed[self.slots] == self.start).all()
        )

    def valid_ahead(self, num_rows: int) -> bool:
        """``valid`` of a batch scheduled ahead (``Scheduler.schedule_ahead``) before the
        step in flight was updated: every slot holds its sequence where it was when the
        batch was scheduled (``prior``), short of the position it was scheduled at by the
        tokens the step in flight computes (its last is the token that step samples)."""
        computed = self.state.computed[self.slots]
        prior = self.start - 1 if self.prior is None else self.prior
        return self.current(num_rows) and bool((computed == prior).all())


class SlotState:
    """Preallocated per-slot arrays of the running sequences (see the module docstring).

    Grows (doubling) when more sequences run at once than ``capacity``; a slot's number
    never changes while its sequence runs."""

    def __init__(self, capacity: int, width: int, stop_width: int = MAX_WINDOW_STOP_IDS) -> None:
        import numpy as np  # lazily: the CLI imports the scheduler, ``llmc --version`` no numpy

        self._np = np
        self.capacity = 0
        self.width = width
        self.stop_width = stop_width
        for name in _INT_FIELDS:
            setattr(self, name, np.zeros(0, dtype=np.int64))
        for name in _BOOL_FIELDS:
            setattr(self, name, np.zeros(0, dtype=bool))
        self.stops = np.zeros((0, stop_width), dtype=np.int64)
        self.stop_cols = 0
        """Columns of ``stops`` any slot has used (the rest are -1 everywhere)."""
        self.table = np.zeros((0, width), dtype=np.int32)
        self._free: list[int] = []
        self._grow(max(1, capacity))

    def _grow(self, capacity: int) -> None:
        np = self._np
        old = self.capacity
        for name in (*_INT_FIELDS, *_BOOL_FIELDS):
            arr = getattr(self, name)
            new = np.zeros(capacity, dtype=arr.dtype)
            new[:old] = arr
            setattr(self, name, new)
        stops = np.full((capacity, self.stop_width), -1, dtype=np.int64)
        stops[:old] = self.stops
        self.stops = stops
        table = np.full((capacity, self.width), -1, dtype=np.int32)
        table[:old] = self.table
        self.table = table
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest slot taken first
        self.capacity = capacity

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def assign(self, seq: Sequence, stop_ids: frozenset[int]) -> int:
        """Give running ``seq`` a slot (its own if it has one) and write every field of it;
        ``stop_ids``: the ids that stop it (``Scheduler._stop_ids``)."""
        if seq.slot < 0:
            if not self._free:
                self._grow(2 * self.capacity)
            seq.slot = self._free.pop()
        s = seq.slot
        ids = sorted(stop_ids)
        row = self.stops[s]
        row[:] = -1
        self.many_stops[s] = len(ids) > self.stop_width
        if not self.many_stops[s]:
            row[: len(ids)] = ids
            self.stop_cols = max(self.stop_cols, len(ids))
        self.min_tokens[s] = seq.sampling.min_tokens
        self.prompt_len[s] = len(seq.prompt_token_ids)
        self.grouped[s] = seq.group is not None
        self.plain[s] = seq.sampling.is_plain
        self.gen[s] += 1
        self.table[s] = -1
        self.blocks[s] = 0
        self.table_version[s] = -1
        self.write(seq)
        return s

    def release(self, seq: Sequence) -> None:
        """``seq`` stopped running (finish, preemption): its slot is free again."""
        if seq.slot >= 0:
            self.gen[seq.slot] += 1
            self._free.append(seq.slot)
            seq.slot = -1

    def write(self, seq: Sequence) -> None:
        """Row ``seq.slot`` := the fields of ``seq`` that change while it runs (after a
        change made outside the vectorised paths); nothing for a sequence not running."""
        s = seq.slot
        if s < 0:
            return
        self.advance(seq)
        self.max_new[s] = seq.max_new_tokens
        self.shares[s] = seq.shares_last_block
        self.write_table(seq)

    def write_table(self, seq: Sequence) -> None:
        """Row ``seq.slot``'s block table := ``seq``'s (only the appended entries unless its
        table was reset): all ``write`` needs after ``KVCacheManager.append_slots`` of a
        sequence whose last block is its own (nothing else of it changes there)."""
        s = seq.slot
        if s >= 0 and seq.block_table_version != self.table_version[s]:
            blocks = seq.block_table
            n = min(len(blocks), self.width)
            f = int(self.blocks[s])
            if seq.block_table_reset_version > self.table_version[s]:  # a new table
                self.table[s, n:f] = -1
                f = 0
            self.table[s, f:n] = blocks[f:n]
            self.blocks[s] = n
            self.table_version[s] = seq.block_table_version

    def append_blocks(
        self, kv: Any, seqs: list[Sequence], slots: Any, rows: Any, ends: Any
    ) -> bool:
        """One new block for each of decode ``rows`` (indices into ``seqs`` / ``slots``, their
        last blocks their own) whose tokens now reach ``ends[row]``: ``kv.append_blocks``
        and their table rows updated at once (each mirrored table is current, so its
        version moves by one). False, with nothing changed, unless every row needs exactly
        one block within ``width`` and enough are free (the caller's per-row loop decides)."""
        if not len(rows):
            return True
        np, tpb = self._np, kv.tokens_per_block
        gs = slots[rows]
        have = self.blocks[gs]
        if not bool(((ends[rows] <= (have + 1) * tpb) & (have < self.width)).all()):
            return False
        new = kv.append_blocks([seqs[i] for i in rows.tolist()])
        if new is None:
            return False
        self.table[gs, have] = np.asarray(new, dtype=self.table.dtype)
        self.blocks[gs] = have + 1
        self.table_version[gs] += 1
        return True

    def advance(self, seq: Sequence) -> None:
        """Row ``seq.slot`` := its computed tokens, output count and last token (what a
        step's update changes; ``write`` for anything else)."""
        s = seq.slot
        if s >= 0:
            out = seq.output_token_ids
            self.computed[s] = seq.num_computed_tokens
            self.num_out[s] = len(out)
            self.last[s] = out[-1] if out else seq.prompt_token_ids[-1]

    def write_all(self, seqs: Any) -> None:
        for seq in seqs:
            self.write(seq)

    def mismatches(self, seqs: Any, stop_ids: Any) -> list[str]:
        """Every difference between the arrays and running sequences ``seqs`` (empty when
        the mirror holds); ``stop_ids(seq)``: the ids that stop a sequence. Also checks that
        no two sequences share a slot and that a slot in use is not on the free list."""
        out: list[str] = []
        seen: dict[int, int] = {}
        free = set(self._free)
        for seq in seqs:
            s = seq.slot
            name = f"request {seq.request_id} branch {seq.branch}"
            if s < 0 or s >= self.capacity:
                out.append(f"{name}: running without a slot ({s})")
                continue
            if s in seen:
                out.append(f"{name}: slot {s} is request {seen[s]}'s too")
            seen[s] = seq.request_id
            if s in free:
                out.append(f"{name}: slot {s} is on the free list")
            ids = sorted(stop_ids(seq))
            out_ids = seq.output_token_ids
            want = {
                "computed": seq.num_computed_tokens,
                "num_out": len(out_ids),
                "last": out_ids[-1] if out_ids else seq.prompt_token_ids[-1],
                "prompt_len": len(seq.prompt_token_ids),
                "max_new": seq.max_new_tokens,
                "blocks": min(len(seq.block_table), self.width),
                "table_version": seq.block_table_version,
                "plain": seq.sampling.is_plain,
                "min_tokens": seq.sampling.min_tokens,
                "shares": seq.shares_last_block,
                "grouped": seq.group is not None,
                "many_stops": len(ids) > self.stop_width,
            }
            for field, value in want.items():
                got = getattr(self, field)[s].item()
                if got != value:
                    out.append(f"{name}: {field} is {got} in slot {s}, {value} on the object")
            n = min(len(seq.block_table), self.width)
            table = self.table[s].tolist()
            if table != seq.block_table[:n] + [-1] * (self.width - n):
                out.append(f"{name}: block table {table} in slot {s}, {seq.block_table}")
            if len(ids) <= self.stop_width:
                row = [int(x) for x in self.stops[s] if x >= 0]
                if row != ids:
                    out.append(f"{name}: stop ids {row} in slot {s}, {ids} on the object")
        return out
