"""The sampling columns of running sequences by slot, for decode rows made over the
scheduler's slot arrays (``ScheduledBatch.rows``, runtime/slot_state.py).

``SlotColumns`` keeps each slot's seed and constant sampling columns (``sampling.
row_columns``) and the slot generation (``SlotState.gen``) it computed them for; a decode
step reads them by the rows' slots and recomputes only the slots whose sequence changed
since (assigned again). A sequence's ``sampling`` and ``branch`` never change while it runs,
so a slot's columns stay right until its generation does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.runtime import sampling as smp
from llmc.runtime.types import RequestFault


def fill_columns(cols: Any, r: int, seq: Any) -> None:
    """Row ``r`` of ``cols``' ``seed``, ``top_k``, ``floats`` and ``plain`` arrays := the
    sampling columns of ``seq`` (``sampling.row_columns``); a sequence whose columns cannot
    be built is a RequestFault of its request, and nothing is written. Shared by this
    module's SlotColumns and decode_row_cache's DecodeRowCache."""
    try:
        seed, const = smp.row_columns(seq)
    except Exception as e:  # this request's params only
        raise RequestFault.caused(seq.request_id, "building its sampling columns", e) from e
    cols.seed[r], cols.top_k[r], cols.floats[r] = seed, const[0], const[1:]
    cols.plain[r] = seq.sampling.is_plain


class SlotColumns:
    """Seed, top_k, float columns and the plain flag per slot (see the module docstring)."""

    def __init__(self) -> None:
        self._state: Any = None
        self._resize(0)

    def _resize(self, capacity: int) -> None:
        self.gen = np.full(capacity, -1, dtype=np.int64)
        self.seed = np.zeros(capacity, dtype=np.int64)
        self.top_k = np.zeros(capacity, dtype=np.int32)
        self.floats = np.zeros((capacity, len(smp.FLOAT_COLUMNS)), dtype=np.float32)
        self.plain = np.zeros(capacity, dtype=bool)

    def rows(self, slot_rows: Any) -> np.ndarray:
        """The rows [b] int64 of ``slot_rows`` (a ``DecodeRows``) in these arrays: their
        slots, each slot's columns up to date. A row whose columns cannot be built is a
        RequestFault of its request."""
        st, slots = slot_rows.state, slot_rows.slots
        if st is not self._state or len(self.gen) < st.capacity:
            old = (self.gen, self.seed, self.top_k, self.floats, self.plain)
            n = len(old[0]) if st is self._state else 0  # a new state: nothing is valid
            self._resize(st.capacity)
            cur = (self.gen, self.seed, self.top_k, self.floats, self.plain)
            for new, arr in zip(cur, old, strict=True):
                new[:n] = arr[:n]
            self._state = st
        for i in np.flatnonzero(self.gen[slots] != slot_rows.gens).tolist():
            s = int(slots[i])
            fill_columns(self, s, slot_rows.seqs[i])
            self.gen[s] = slot_rows.gens[i]
        return slots
