"""The decode row cache of ``StepInputBuilder`` (runtime/step_inputs.py): each decoding
sequence's block table, prompt length and sampling columns kept across decode steps, so a
decode step whose batch has no slot rows (``ScheduledBatch.rows``) reads each sequence in a
few C-level passes instead of rebuilding its rows from Python lists.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from llmc.runtime import sampling as smp
from llmc.runtime.slot_columns import fill_columns


class DecodeRowCache:
    """Per-sequence state kept across decode steps, so a decode step reads each sequence in
    a few C-level passes instead of rebuilding its rows from Python lists.

    A row holds a sequence's block-table entries (int32, -1 beyond), its prompt length,
    seed and constant sampling columns. Rows are keyed by Sequence identity (the cache
    keeps the object, so its id is not reused while the row lives).

    Block tables follow the KVCacheManager's version contract (``Sequence.
    block_table_version``, runtime/kv_cache.py), never the list object's identity: a row
    re-reads its sequence's table exactly when the version differs from the one it copied,
    only the appended blocks when no reset happened since (``block_table_reset_version``),
    else the whole table. A sequence's ``prompt_token_ids`` and ``sampling`` are never
    replaced or mutated after it is created (nothing in the runtime does); they are
    re-checked (by identity) whenever the batch's sequences differ from the previous decode
    step's. When the rows run out, the cache starts over with the current batch.
    """

    def __init__(self, capacity: int, width: int) -> None:
        self.capacity, self.width = capacity, width
        self.table = np.full((capacity, width), -1, dtype=np.int32)
        self.filled = np.zeros(capacity, dtype=np.int64)  # min(len(block_table), width)
        self.version = np.full(capacity, -1, dtype=np.int64)  # block_table_version copied
        self.seed = np.zeros(capacity, dtype=np.int64)
        self.top_k = np.zeros(capacity, dtype=np.int32)
        self.floats = np.zeros((capacity, len(smp.FLOAT_COLUMNS)), dtype=np.float32)
        self.plain = np.zeros(capacity, dtype=bool)
        self.prompt_len = np.zeros(capacity, dtype=np.int64)
        self._clear()

    def _clear(self) -> None:
        self.seqs: list[Any] = [None] * self.capacity
        self.params: list[Any] = [None] * self.capacity
        self.prompts: list[Any] = [None] * self.capacity
        self.row_of: dict[int, int] = {}
        self.next = 0
        self._last_seqs: list[Any] = []
        self._last_idx = np.zeros(0, dtype=np.int64)

    def _fill(self, r: int, seq: Any) -> None:
        """(Re)fill row ``r`` from ``seq`` (its blocks are copied in by ``rows``). A row
        whose columns cannot be built is a RequestFault of its request; nothing is kept."""
        fill_columns(self, r, seq)
        self.seqs[r], self.params[r] = seq, seq.sampling
        self.prompts[r] = seq.prompt_token_ids
        self.prompt_len[r] = len(seq.prompt_token_ids)
        self.table[r] = -1
        self.filled[r] = 0
        self.version[r] = -1

    def rows(self, seqs: list[Any], versions: np.ndarray) -> np.ndarray:
        """The rows [b] int64 of ``seqs`` (whose ``block_table_version`` are ``versions``),
        their tables up to date (``filled`` = min(len(block_table), width) blocks)."""
        if not (
            len(seqs) == len(self._last_seqs) and all(map(operator.is_, seqs, self._last_seqs))
        ):
            self._last_idx = self._locate(seqs)
            self._last_seqs = seqs
        idx = self._last_idx
        for i in np.nonzero(versions != self.version[idx])[0].tolist():
            self._copy_blocks(int(idx[i]), seqs[i])
        return idx

    def _locate(self, seqs: list[Any]) -> np.ndarray:
        """The rows of ``seqs``: new sequences get a row; a row whose sequence's params or
        prompt object changed is refilled."""
        rows = list(map(self.row_of.get, map(id, seqs)))
        if None in rows:
            missing = [i for i, r in enumerate(rows) if r is None]
            if self.next + len(missing) > self.capacity:
                self._clear()
                missing, rows = list(range(len(seqs))), [None] * len(seqs)
            for i in missing:  # the row is taken once it is filled (a fault takes none)
                self._fill(self.next, seqs[i])
                r = rows[i] = self.next
                self.next += 1
                self.row_of[id(seqs[i])] = r
        for i, r in enumerate(rows):
            seq = seqs[i]
            if seq.sampling is not self.params[r] or seq.prompt_token_ids is not self.prompts[r]:
                self._fill(r, seq)
        return np.asarray(rows, dtype=np.int64)

    def _copy_blocks(self, r: int, seq: Any) -> None:
        """Bring row ``r`` to ``seq``'s current table version."""
        blocks = seq.block_table
        n = min(len(blocks), self.width)
        f = int(self.filled[r])
        if seq.block_table_reset_version > self.version[r]:  # a new table: refill the row
            self.table[r, n:f] = -1
            f = 0
        self.table[r, f:n] = blocks[f:n]
        self.filled[r] = n
        self.version[r] = seq.block_table_version
