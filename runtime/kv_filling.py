"""The KV manager's view of the blocks a step in flight fills (no torch).

A mixin of ``KVCacheManager`` (runtime/kv_cache.py, whose docstring states the rules). A
step's full blocks are registered for reuse at its update (``register_full_blocks``), so a
step scheduled ahead of that update (``Scheduler.schedule_ahead``) would admit a request
that shares them without sharing: it would compute them again. ``filling_hashes`` names the
blocks a step's prompt chunks fill, and ``hits_after`` tells whether a waiting request's
prefix runs into one of them, so the admission ahead leaves it for the next step, which
shares them.
"""

from __future__ import annotations

from typing import Any

from llmc.runtime.block_hash import BlockHash
from llmc.runtime.types import Sequence


class FillingBlocks:
    """``KVCacheManager`` methods about a step in flight's blocks (see the module docstring)."""

    tokens_per_block: int
    enable_block_reuse: bool
    # and KVCacheManager's is_allocated, _chain, _hashes

    def filling_hashes(self, rows: Any) -> set[BlockHash]:
        """The hashes of the blocks that prompt chunks ``rows`` (ScheduledSequences of a step
        not yet updated) fill: its update registers them (empty without block reuse)."""
        if not self.enable_block_reuse:
            return set()
        tpb, out = self.tokens_per_block, set()
        for ss in rows:
            seq = ss.seq
            first, end = ss.start_position // tpb, (ss.start_position + ss.num_new_tokens) // tpb
            if end > first and self.is_allocated(seq):
                out.update(self._chain(seq, end)[first:end])
        return out

    def hits_after(self, seq: Sequence, hits: list[int], filling: set[BlockHash]) -> bool:
        """Whether not-yet-admitted ``seq``'s prefix goes on past its ``hits``
        (``prefix_hits``) into a block whose hash is in ``filling`` (``filling_hashes``):
        after that step's update it would share that block too."""
        i = len(hits)
        if not filling or i >= (seq.num_tokens - 1) // self.tokens_per_block:
            return False
        if seq.sampling.prompt_logprobs is not None:
            return False
        return self._hashes(seq, i + 1)[i] in filling
