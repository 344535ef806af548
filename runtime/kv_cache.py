"""KVCacheManager: the paged KV-cache block pool, refcounts and prefix reuse (no torch).

The pool has ``num_blocks`` blocks of ``tokens_per_block`` token slots each; a sequence owns
the blocks listed in ``seq.block_table`` and token position ``p`` lives in slot
``block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block``.

Prefix reuse (``enable_block_reuse``): once every token of a *full* block is computed, the
block is registered under the chained hash of its prefix (``llmc.runtime.block_hash``). A newly
admitted sequence takes the longest run of registered blocks matching its first tokens and
starts with ``num_computed_tokens`` at their end. A shared block is never written: at least the
sequence's last known token is always recomputed, in a block the sequence owns alone.

The table versions are this module's contract with whoever copies a block table (the step
inputs' decode row cache): every change of ``seq.block_table`` bumps
``seq.block_table_version`` (``_reset_table`` at admission and free, ``append_slots``), and
between two resets a table changes only by blocks appended at its end.

Forks (several sequences of one request: n / best_of samples, beams; ``share``): a sequence
takes another's block table, every block's refcount going up, and is marked
``shares_last_block``. Full blocks are never written again, so sharing them is free; the
partial last block is copied on write: ``append_slots`` gives a sequence about to write into
a last block that another table holds too a fresh block, queues the (source, destination)
copy for the runner (``take_copies``, handed over in the ScheduledBatch) and resets the
table's version. The per-sequence state here is keyed by ``Sequence.key`` (request, branch).

Free blocks sit in one intrusive doubly-linked list (arrays of prev/next ids, O(1) push, pop
and unlink from the middle). Blocks with no reusable content are kept at the head, so they are
allocated first; freed blocks that still hold a registered hash go to the tail in LRU order and
are evicted (their hash dropped) only when allocated for new content. Reviving a cached free
block unlinks it from the middle of the list.

Invariants (``check_invariants`` verifies them; the tests call it after every step):
- a block is in the free list iff its refcount is 0; refcounts are never negative;
- ``num_free_blocks`` equals the length of the free list;
- every registered hash maps to a block that carries that hash;
- a block's refcount is the number of block tables that hold it (``check_refcounts``);
- after every sequence is freed, ``num_free_blocks == total_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.base.errors import ConfigError
from llmc.runtime.block_hash import ROOT_HASH, BlockHash, block_hash
from llmc.runtime.kv_decode_rows import DecodeRowBlocks
from llmc.runtime.kv_filling import FillingBlocks
from llmc.runtime.types import Sequence


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the pool's counters; the numbers derived from them (used blocks, hit
    rate, utilization) are properties, computed here only. Reuse counts are in blocks
    (full blocks looked up at admission)."""

    total_blocks: int
    free_blocks: int
    peak_used_blocks: int
    reuse_hits: int
    reuse_misses: int
    cached_blocks: int
    """Blocks holding a registered hash (in use or free and reusable)."""
    tokens_per_block: int

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def hit_rate(self) -> float:
        """reuse_hits / (reuse_hits + reuse_misses); 0.0 before any lookup or with reuse off."""
        looked_up = self.reuse_hits + self.reuse_misses
        return self.reuse_hits / looked_up if looked_up else 0.0

    @property
    def utilization(self) -> float:
        return self.used_blocks / self.total_blocks

    @property
    def peak_utilization(self) -> float:
        return self.peak_used_blocks / self.total_blocks


@dataclass
class _Counters:
    """What the pool counts as it runs, named as in KVCacheStats (copied into each one)."""

    peak_used_blocks: int = 0
    reuse_hits: int = 0
    reuse_misses: int = 0


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"KV cache {name} must be a positive integer, got {value!r}")
    return value


class KVCacheManager(DecodeRowBlocks, FillingBlocks):
    """Fixed pool of KV blocks with refcounts, an O(1) free list and prefix-block reuse."""

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool = True):
        self.total_blocks = _positive_int("num_blocks", num_blocks)
        self.tokens_per_block = _positive_int("tokens_per_block", tokens_per_block)
        self.enable_block_reuse = bool(enable_block_reuse)
        n = num_blocks
        self._ref = [0] * n
        self._hash: list[BlockHash | None] = [None] * n
        # Circular free list with a sentinel at index n; initially 0, 1, ..., n-1 in order.
        self._sentinel = n
        self._next = [i + 1 for i in range(n)] + [0]
        self._prev = [n] + [i for i in range(n)]
        self._num_free = n
        self._cached: dict[BlockHash, int] = {}
        # Per admitted request: hashes of its full blocks computed so far (a cache of the
        # chain) and how many leading blocks of its table already carry a hash.
        self._seq_hashes: dict[tuple[int, int], list[BlockHash]] = {}
        self._seq_registered: dict[tuple[int, int], int] = {}
        self._copies: list[tuple[int, int]] = []  # copy-on-write since take_copies
        self._counts = _Counters()

    # ---------------------------------------------------------------- free list (O(1))
    def _unlink(self, b: int) -> None:
        p, nx = self._prev[b], self._next[b]
        self._next[p] = nx
        self._prev[nx] = p
        self._prev[b] = self._next[b] = -1
        self._num_free -= 1

    def _link_after(self, anchor: int, b: int) -> None:
        nx = self._next[anchor]
        self._prev[b], self._next[b] = anchor, nx
        self._next[anchor] = b
        self._prev[nx] = b
        self._num_free += 1

    def _pop_free(self) -> int:
        b = self._next[self._sentinel]
        self._unlink(b)
        h = self._hash[b]
        if h is not None:  # evict: the block is about to hold new content
            if self._cached.get(h) == b:
                del self._cached[h]
            self._hash[b] = None
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        ref = self._ref[b] - 1
        if ref < 0:
            raise RuntimeError(f"KV block {b} freed more often than it was referenced")
        self._ref[b] = ref
        if ref == 0:
            if self._hash[b] is None:
                self._link_after(self._sentinel, b)  # head: worthless, reuse first
            else:
                self._link_after(self._prev[self._sentinel], b)  # tail: LRU eviction order

    def _note_usage(self) -> None:
        used = self.total_blocks - self._num_free
        if used > self._counts.peak_used_blocks:
            self._counts.peak_used_blocks = used

    # ---------------------------------------------------------------- hashing
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chained hashes of the first ``num_blocks`` full blocks of ``seq``.

        Memoized per request (a sequence's tokens never change once known) until ``free``."""
        return self._chain(seq, num_blocks)[:num_blocks]

    def _chain(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """``seq``'s memo of chained block hashes, extended to at least ``num_blocks`` (the
        list itself, not a copy: ``register_full_blocks`` reads a few of its entries)."""
        hashes = self._seq_hashes.setdefault(seq.key, [])
        if len(hashes) >= num_blocks:
            return hashes
        tpb = self.tokens_per_block
        parent = hashes[-1] if hashes else ROOT_HASH
        n_prompt = seq.num_prompt_tokens
        for i in range(len(hashes), num_blocks):
            lo, hi = i * tpb, (i + 1) * tpb
            if hi <= n_prompt:
                tokens = seq.prompt_token_ids[lo:hi]
            elif lo >= n_prompt:
                tokens = seq.output_token_ids[lo - n_prompt : hi - n_prompt]
            else:
                tokens = [*seq.prompt_token_ids[lo:], *seq.output_token_ids[: hi - n_prompt]]
            parent = block_hash(parent, tokens)
            hashes.append(parent)
        return hashes

    def _lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest registered prefix of ``seq`` that may be shared.

        At most ``(num_tokens - 1) // tokens_per_block`` blocks: the last known token is
        always recomputed (it produces the next token's logits), in a block of its own.
        None shared for a request with ``prompt_logprobs`` (every prompt position must be
        computed, as in vLLM).
        """
        if (
            not self.enable_block_reuse
            or not self._cached
            or seq.sampling.prompt_logprobs is not None
        ):
            return []
        max_blocks = (seq.num_tokens - 1) // self.tokens_per_block
        hits: list[int] = []
        for h in self._hashes(seq, max_blocks):
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # ---------------------------------------------------------------- public API
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.total_blocks - self._num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.tokens_per_block)

    def is_allocated(self, seq: Sequence) -> bool:
        """True between ``allocate_prefix(seq)`` and ``free(seq)``."""
        return seq.key in self._seq_registered

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a not-yet-admitted ``seq`` that ``allocate_prefix`` would serve from cache."""
        return len(self.prefix_hits(seq)) * self.tokens_per_block

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks a not-yet-admitted ``seq`` would share (empty once admitted):
        what ``num_blocks_needed`` and ``allocate_prefix`` look up, for a caller that asks
        all three about one sequence with no cache change between (the scheduler's
        admission) to pass as their ``hits``."""
        return [] if self.is_allocated(seq) else self._lookup_prefix(seq)

    def num_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None
    ) -> int:
        """Free blocks that computing ``num_new_tokens`` more tokens of ``seq`` would take.

        For an admitted sequence the new tokens follow ``num_computed_tokens``; for one not yet
        admitted they follow its cached prefix (``hits``: ``prefix_hits(seq)``, looked up
        when None), and reviving cached blocks that are currently free counts too (they
        leave the free list).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self.is_allocated(seq):
            have = len(seq.block_table)
            grow = max(0, self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - have)
            return grow + (num_new_tokens > 0 and self._copies_last(seq))
        if hits is None:
            hits = self._lookup_prefix(seq)
        revived = sum(1 for b in hits if self._ref[b] == 0)
        need = self.blocks_for_tokens(len(hits) * self.tokens_per_block + num_new_tokens)
        return revived + max(0, need - len(hits))

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None
    ) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, hits) <= self._num_free

    def allocate_prefix(self, seq: Sequence, hits: list[int] | None = None) -> int:
        """Admit ``seq``: share its cached prefix blocks and set ``num_computed_tokens``
        (``hits``: ``prefix_hits(seq)`` with no cache change since, looked up when None).

        Returns the number of cached tokens (a multiple of tokens_per_block, < num_tokens).
        """
        if self.is_allocated(seq) or seq.block_table:
            raise RuntimeError(f"request {seq.request_id} is already admitted to the KV cache")
        if hits is None:
            hits = self._lookup_prefix(seq)
        if self.enable_block_reuse and seq.sampling.prompt_logprobs is None:
            eligible = (seq.num_tokens - 1) // self.tokens_per_block
            self._counts.reuse_hits += len(hits)
            self._counts.reuse_misses += eligible - len(hits)
        for b in hits:
            if self._ref[b] == 0:
                self._unlink(b)
            self._ref[b] += 1
        self._seq_registered[seq.key] = len(hits)
        self._reset_table(seq, list(hits))
        cached = len(hits) * self.tokens_per_block
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        self._note_usage()
        return cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns False (and changes nothing) when there are not enough free blocks.
        """
        if not self.is_allocated(seq):
            raise RuntimeError(f"request {seq.request_id} is not admitted (allocate_prefix first)")
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need > self._num_free:
            return False
        table = seq.block_table
        if seq.shares_last_block and num_new_tokens > 0:
            if self._copies_last(seq):  # copy-on-write: the last block gets a copy of its own
                src, dst = table[-1], self._pop_free()
                self._ref[src] -= 1  # still >= 1: another table holds it
                self._copies.append((src, dst))
                self._reset_table(seq, [*table[:-1], dst])
                table = seq.block_table
                need -= 1
            seq.shares_last_block = False  # written below: from now on its own
        if need:
            for _ in range(need):
                table.append(self._pop_free())
            seq.block_table_version += 1
        if need or self._copies:
            self._note_usage()
        return True

    def _copies_last(self, seq: Sequence) -> bool:
        """Whether the next write of ``seq`` lands in a last block another table holds."""
        table = seq.block_table
        return (
            seq.shares_last_block
            and bool(table)
            and seq.num_computed_tokens < len(table) * self.tokens_per_block
            and self._ref[table[-1]] > 1
        )

    def share(self, parents: list[Sequence], children: list[Sequence]) -> None:
        """Fork: ``children[j]`` takes the block table of ``parents[j]`` (a parent may be
        listed several times, and a child may be one of the parents: a beam reorder).

        Every shared block gains a reference before a child's old table is released, so a
        block some new table holds never reaches the free list. Each child is marked
        ``shares_last_block`` (its first write into that block copies it when still shared)
        and gets a new table version (a reset); so is each parent still admitted. No block is
        allocated here."""
        if len(parents) != len(children):
            raise ValueError(f"share: {len(parents)} parents for {len(children)} children")
        snap = []
        for p in parents:
            if not self.is_allocated(p):
                raise RuntimeError(f"request {p.request_id}: forked from a sequence not admitted")
            snap.append((list(p.block_table), list(self._seq_hashes.get(p.key, ())),
                         self._seq_registered[p.key], p.num_computed_tokens))  # fmt: skip
        for table, *_ in snap:
            for b in table:
                self._ref[b] += 1
        for c in children:
            for b in reversed(c.block_table if self.is_allocated(c) else ()):
                self._release(b)
        for c, (table, hashes, registered, computed) in zip(children, snap, strict=True):
            self._reset_table(c, table)
            self._seq_hashes[c.key] = hashes
            self._seq_registered[c.key] = registered
            c.num_computed_tokens = computed
        for seq in (*parents, *children):  # a parent's last block is shared now too
            seq.shares_last_block = self.is_allocated(seq)

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The (source, destination) block copies queued since the last call: the runner
        makes them before the step's forward (the step writes into the destinations)."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def register_full_blocks(self, seq: Sequence) -> int:
        """Register every full, computed block of ``seq`` for reuse; returns how many are new.

        A block whose content is already registered under another block stays unregistered
        (it is freed as plain, worthless space).
        """
        rid = seq.key
        done = self._seq_registered.get(rid)
        if done is None or not self.enable_block_reuse:
            return 0
        table = seq.block_table
        full = min(seq.num_computed_tokens // self.tokens_per_block, len(table))
        if full <= done:
            return 0
        hashes = self._chain(seq, full)
        added = 0
        for i in range(done, full):
            b, h = table[i], hashes[i]
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b
                added += 1
        self._seq_registered[rid] = full
        return added

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (registered content stays reusable until evicted).

        Blocks are released last-first so that a sequence's deepest blocks are evicted before
        the prefix blocks other prompts are more likely to share.
        """
        for b in reversed(seq.block_table):
            self._release(b)
        self._reset_table(seq, [])
        self._seq_registered.pop(seq.key, None)
        self._seq_hashes.pop(seq.key, None)
        seq.shares_last_block = False

    @staticmethod
    def _reset_table(seq: Sequence, blocks: list[int]) -> None:
        """Give ``seq`` a new table (not an append): a new version, which is a reset."""
        seq.block_table = blocks
        seq.block_table_version += 1
        seq.block_table_reset_version = seq.block_table_version

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot of token ``position`` of ``seq``."""
        tpb = self.tokens_per_block
        if not 0 <= position < len(seq.block_table) * tpb:
            raise IndexError(
                f"position {position} of request {seq.request_id} is outside its "
                f"{len(seq.block_table)} blocks of {tpb} tokens"
            )
        return seq.block_table[position // tpb] * tpb + position % tpb

    def slot_mapping(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        """Cache slots of tokens ``[start, start + num_tokens)`` of ``seq``."""
        return [self.slot(seq, p) for p in range(start, start + num_tokens)]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def stats(self) -> KVCacheStats:
        """The pool's state and counters now (``KVCacheStats`` derives the rest)."""
        return KVCacheStats(
            **vars(self._counts),
            total_blocks=self.total_blocks,
            free_blocks=self._num_free,
            cached_blocks=len(self._cached),
            tokens_per_block=self.tokens_per_block,
        )

    def free_block_ids(self) -> list[int]:
        """Free blocks in allocation order (head first): for tests and debugging."""
        out, b = [], self._next[self._sentinel]
        while b != self._sentinel:
            out.append(b)
            b = self._next[b]
        return out

    def check_refcounts(self, seqs: list[Sequence]) -> None:
        """Raise RuntimeError unless every block's refcount equals the number of the block
        tables of ``seqs`` (every admitted sequence) that hold it."""
        held = [0] * self.total_blocks
        for seq in seqs:
            for b in seq.block_table:
                held[b] += 1
        for b, (r, h) in enumerate(zip(self._ref, held, strict=True)):
            if r != h:
                raise RuntimeError(f"KV block {b} has refcount {r} but {h} tables hold it")

    def check_invariants(self) -> None:
        """Raise RuntimeError if the pool's bookkeeping is inconsistent (O(num_blocks))."""
        free = self.free_block_ids()
        if len(free) != self._num_free or len(set(free)) != len(free):
            raise RuntimeError(f"free list has {len(free)} entries, counter says {self._num_free}")
        in_free = set(free)
        for b in range(self.total_blocks):
            r = self._ref[b]
            if r < 0:
                raise RuntimeError(f"KV block {b} has refcount {r}")
            if (r == 0) != (b in in_free):
                raise RuntimeError(f"KV block {b}: refcount {r} but in free list: {b in in_free}")
        for h, b in self._cached.items():
            if self._hash[b] != h:
                raise RuntimeError(f"registered hash maps to KV block {b}, which holds another")
        if sum(1 for h in self._hash if h is not None) != len(self._cached):
            raise RuntimeError("a KV block carries a hash that is not registered")
