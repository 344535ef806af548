"""Token times of deferred decode rows, kept once per step instead of once per row (no torch).

A deferred request (non-streaming, no stop strings, see ``RequestState.deferred``) shows
nothing until it ends: per decode step its only bookkeeping is the time of its new token
(``RequestRecord.token_times``) and ``RequestState.num_seen``. ``TokenRuns`` keeps those
for the rows of a decode step over slots (``ScheduledBatch.rows``) without a Python pass
per row: each such step appends its time (and the tokens each row made in it: 1, or a
multi-step window's ``k``) to one log, and a row in consecutive such steps holds a *run* of
that log (``[start, end)`` in its slot's arrays): its tokens' times are the log's entries of
the run, each repeated by its count. ``settle`` writes a run into its request's
record (and ``num_seen``); ``RequestState`` settles before anything reads them (a response,
its final one, an error, a cancel), so what the records and responses say is what a
per-row pass would have written.

Invariants:
- A state holds at most one run (``RequestState.run`` is ``(self, slot)``), and slot ``s``
  holds at most one: ``owner[s]`` is the state whose ``run`` names ``s``.
- A run grows only while its slot keeps the sequence it had when the run began
  (``SlotState.gen``) and the row is in every step of the log since; a row that missed a
  step, or whose slot changed hands, has its run settled and a new one begun.
- Only rows of a plain deferred output (no group, no logprobs) whose first token was
  already shown, alive after the step's update (not finished in it) and advanced by exactly
  the step's ``k`` tokens (``SlotState.computed``), take runs; every other row is returned
  to the caller's per-row pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_COMPACT = 1 << 14
"""Log length from which entries no run reads are dropped."""


class TokenRuns:
    """The shared step-time log and the runs of the slots (see the module docstring)."""

    def __init__(self) -> None:
        import numpy as np  # lazily, as SlotState: ``llmc --version`` imports no numpy

        self._np = np
        self.times: list[float] = []
        self.counts: list[int] = []
        """Tokens each row of the step of ``times[i]`` made (1; ``k`` for a window)."""
        self.base = 0
        """Log index of ``times[0]`` (entries before it were dropped: no run read them)."""
        self.start = np.zeros(0, dtype=np.int64)
        self.end = np.zeros(0, dtype=np.int64)
        self.gen = np.zeros(0, dtype=np.int64)
        """The slot's ``SlotState.gen`` when its run began; -1: no run."""
        self.no_gen = np.zeros(0, dtype=np.int64)
        """The gen of a slot's sequence whose rows take no run (-1: none known)."""
        self.owner: list[Any] = []

    def _fit(self, capacity: int) -> None:
        old = len(self.owner)
        if capacity <= old:
            return
        np = self._np
        for name in ("start", "end", "gen", "no_gen"):
            arr = np.full(capacity, -1, dtype=np.int64)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self.owner.extend([None] * (capacity - old))

    def step(self, rows: Any, states: Mapping[int, Any], now: float, k: int = 1) -> list[int]:
        """Record decode step ``rows`` (``DecodeRows``, after its update) at ``now``, ``k``
        tokens a row (a multi-step window's steps): every row that can take a run gets its
        tokens in it. Returns the rows that cannot (in order): the caller's per-row pass
        emits them."""
        np = self._np
        st = rows.state
        slots = rows.slots
        self._fit(st.capacity)
        if len(self.times) >= _COMPACT:
            self._compact()
        at = self.base + len(self.times)  # this step's log index
        self.times.append(now)
        self.counts.append(k)
        # not finished (nor preempted) in the update, and advanced by the step's k tokens
        alive = (st.gen[slots] == rows.gens) & (st.computed[slots] == rows.start + k)
        ok = alive & (self.gen[slots] == rows.gens) & (self.end[slots] == at)
        if ok.all():
            self.end[slots] = at + 1
            return []
        self.end[slots[ok]] = at + 1
        rest: list[int] = []
        gens = rows.gens
        for i in np.flatnonzero(~ok).tolist():
            s = int(slots[i])
            if not alive[i] or self.no_gen[s] == gens[i]:
                rest.append(i)
                continue
            seq = rows.seqs[i]
            state = states.get(seq.request_id)
            if not _plain(state, seq):
                self.no_gen[s] = gens[i]
                rest.append(i)
                continue
            old = self.owner[s]
            if old is not None:  # the slot's last run (this row's, broken, or another's)
                old.settle()
            state.settle()  # its run in another slot, if any
            if len(seq.output_token_ids) - state.num_seen != k:
                rest.append(i)  # (never for a row of consecutive steps: defensive)
                continue
            self.start[s], self.end[s], self.gen[s] = at, at + 1, gens[i]
            self.owner[s] = state
            state.run = (self, s)
        return rest

    def settle(self, state: Any) -> None:
        """Write ``state``'s run (its tokens' times, ``num_seen``) and end it."""
        _, s = state.run
        state.run = None
        a, b = int(self.start[s]) - self.base, int(self.end[s]) - self.base
        counts = self.counts[a:b]
        times = state.record.token_times
        if max(counts) == 1:
            times.extend(self.times[a:b])
        else:
            for t, c in zip(self.times[a:b], counts, strict=True):
                times.extend([t] * c)
        state.num_seen += sum(counts)
        self.owner[s] = None
        self.gen[s] = self.end[s] = -1

    def settle_all(self) -> None:
        """Settle every run (before the records are read as a whole)."""
        for state in [o for o in self.owner if o is not None]:
            state.settle()

    def _compact(self) -> None:
        held = self.start[self.gen >= 0]
        first = int(held.min()) if len(held) else self.base + len(self.times)
        del self.times[: first - self.base]
        del self.counts[: first - self.base]
        self.base = first


def _plain(state: Any, seq: Any) -> bool:
    """Whether ``seq``'s row can take a run: a deferred output of its own, open, without
    logprobs, its first token shown."""
    return (
        state is not None
        and state.deferred
        and not state.final
        and seq.group is None
        and state.outputs is None
        and state.request.sampling.logprobs is None
        and state.record.first_token_time is not None
    )
