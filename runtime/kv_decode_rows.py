"""The KV manager's work for a batch of decode rows at a block boundary (no torch).

A mixin of ``KVCacheManager`` (runtime/kv_cache.py, whose docstring states the rules): at
batch 1024 every row crosses a block boundary in the same step each ``tokens_per_block``
steps, where the per-row ``append_slots`` and ``register_full_blocks`` took ~16 ms a step.
These do the common case of each (one new block a row, its last block its own; one new
full block of outputs a row) with the least work per row, and leave the pool exactly as
the per-row methods would (``tests/runtime/test_kv_cache.py`` compares them).
"""

from __future__ import annotations

from typing import Any

from llmc.runtime.block_hash import ROOT_HASH, block_hash
from llmc.runtime.types import Sequence


class DecodeRowBlocks:
    """``KVCacheManager`` methods over many decode rows (see the module docstring)."""

    tokens_per_block: int
    enable_block_reuse: bool
    _num_free: int
    _seq_registered: dict[Any, int]
    _seq_hashes: dict[Any, list[bytes]]
    _cached: dict[bytes, int]
    _hash: list[bytes | None]
    # and KVCacheManager's register_full_blocks, _pop_free, _note_usage

    def append_blocks(self, seqs: list[Sequence]) -> list[int] | None:
        """``append_slots`` of sequences that each need exactly one more block and hold
        their last block alone (``shares_last_block`` false; the caller checked both): one
        free block appended to each table, in order. Returns the new block ids; None, with
        nothing changed, when fewer blocks are free."""
        if len(seqs) > self._num_free:
            return None
        pop = self._pop_free  # type: ignore[attr-defined]
        new = []
        for seq in seqs:
            b = pop()
            seq.block_table.append(b)
            seq.block_table_version += 1
            new.append(b)
        if new:
            self._note_usage()  # type: ignore[attr-defined]
        return new

    def register_filled_blocks(self, seqs: list[Sequence]) -> None:
        """``register_full_blocks`` of decode rows whose last step filled a block: the common
        case (that one block of outputs is new, the hashes before it memoized) inline, at
        one digest per row; any other row through ``register_full_blocks``."""
        if not self.enable_block_reuse:
            return
        tpb, reg, memo, cached, hashed = (self.tokens_per_block, self._seq_registered,
                                          self._seq_hashes, self._cached, self._hash)  # fmt: skip
        for seq in seqs:
            key = (seq.request_id, seq.branch)  # Sequence.key
            done, hashes = reg.get(key), memo.get(key)
            full = seq.num_computed_tokens // tpb
            lo = done * tpb - len(seq.prompt_token_ids) if done is not None else -1
            if hashes is None or full != done + 1 or len(hashes) != done or lo < 0:
                self.register_full_blocks(seq)  # type: ignore[attr-defined]
                continue
            if full > len(seq.block_table):
                continue  # (register_full_blocks: nothing new)
            h = block_hash(hashes[-1] if done else ROOT_HASH, seq.output_token_ids[lo : lo + tpb])
            hashes.append(h)
            b = seq.block_table[done]
            if hashed[b] is None and h not in cached:
                hashed[b], cached[h] = h, b
            reg[key] = full
