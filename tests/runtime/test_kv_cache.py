"""KVCacheManager: exact block ids, refcounts, free-list order, prefix reuse and eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmc.base.errors import ConfigError
from llmc.runtime.block_hash import ROOT_HASH, block_hash, chain_hashes
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.types import SamplingParams, Sequence


def mkseq(rid: int, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_new_tokens=8), 8, 0.0)


def compute(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    """What the scheduler + runner do for n tokens: allocate, 'compute', register."""
    assert kv.append_slots(seq, n)
    seq.num_computed_tokens += n
    kv.register_full_blocks(seq)


def admit_and_prefill(kv: KVCacheManager, seq: Sequence) -> int:
    cached = kv.allocate_prefix(seq)
    compute(kv, seq, seq.num_tokens - cached)
    return cached


def test_scheduler_side_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import llmc.runtime.kv_cache, llmc.runtime.scheduler, llmc.runtime.block_hash\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_pool_config() -> None:
    with pytest.raises(ConfigError, match="num_blocks must be a positive integer, got 0"):
        KVCacheManager(0, 16)
    with pytest.raises(ConfigError, match="tokens_per_block must be a positive integer"):
        KVCacheManager(8, -1)


def test_allocate_exact_blocks_and_slots() -> None:
    kv = KVCacheManager(8, 4)
    a = mkseq(0, list(range(10)))
    assert kv.allocate_prefix(a) == 0
    assert kv.append_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert [kv.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert kv.slot(a, 0) == 0 and kv.slot(a, 5) == 5 and kv.slot(a, 9) == 9
    a.num_computed_tokens = 10
    assert kv.append_slots(a, 2)  # 12 tokens still fit in 3 blocks
    assert a.block_table == [0, 1, 2]
    assert kv.append_slots(a, 3)  # 13 tokens: a fourth block
    assert a.block_table == [0, 1, 2, 3]
    assert kv.slot_mapping(a, 11, 3) == [11, 12, 13]
    with pytest.raises(IndexError, match="position 16 of request 0"):
        kv.slot(a, 16)
    b = mkseq(1, list(range(100, 120)))
    kv.allocate_prefix(b)
    assert not kv.can_allocate(b, 20) and not kv.append_slots(b, 20)  # 5 > 4 free
    assert b.block_table == [] and kv.num_free_blocks == 4  # nothing changed
    assert kv.append_slots(b, 16)
    assert b.block_table == [4, 5, 6, 7]
    assert kv.stats().peak_used_blocks == 8
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 8 and kv.stats().used_blocks == 0


def test_prefix_reuse_shares_full_blocks() -> None:
    kv = KVCacheManager(16, 4)
    a = mkseq(0, list(range(13)))  # blocks 0,1,2 full, block 3 holds token 12
    assert admit_and_prefill(kv, a) == 0
    assert a.block_table == [0, 1, 2, 3]
    assert kv.stats().cached_blocks == 3
    # Shares the first 8 tokens, then differs.
    b = mkseq(1, list(range(8)) + [99, 98, 97, 96, 95])
    assert kv.cached_prefix_tokens(b) == 8
    assert kv.num_blocks_needed(b, 5) == 2
    assert admit_and_prefill(kv, b) == 8
    assert b.num_computed_tokens == 13 and b.num_cached_tokens == 8
    assert b.block_table == [0, 1, 4, 5]
    assert [kv.ref_count(x) for x in range(6)] == [2, 2, 1, 1, 1, 1]
    s = kv.stats()
    assert (s.reuse_hits, s.reuse_misses) == (2, 3 + 1)  # a: 3 misses; b: 2 hits, 1 miss
    assert s.hit_rate == pytest.approx(2 / 6)
    kv.free(a)
    assert [kv.ref_count(x) for x in range(6)] == [1, 1, 0, 0, 1, 1]
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 16


def test_fully_cached_prompt_recomputes_last_block() -> None:
    kv = KVCacheManager(8, 4)
    a = mkseq(0, list(range(12)))  # exactly 3 full blocks
    admit_and_prefill(kv, a)
    assert a.block_table == [0, 1, 2] and kv.stats().cached_blocks == 3
    b = mkseq(1, list(range(12)))
    # Only 2 of 3 blocks may be shared: token 11 must be computed, in a block b owns alone.
    assert kv.allocate_prefix(b) == 8
    assert kv.append_slots(b, 4)
    assert b.block_table == [0, 1, 3]
    assert kv.ref_count(2) == 1 and kv.ref_count(3) == 1
    b.num_computed_tokens = 12
    assert kv.register_full_blocks(b) == 0  # block 3 duplicates block 2's content
    # A prompt one token longer may share all three full blocks.
    c = mkseq(2, list(range(12)) + [50])
    assert kv.allocate_prefix(c) == 12
    assert c.block_table == [0, 1, 2]
    for s in (a, b, c):
        kv.free(s)
    kv.check_invariants()
    assert kv.num_free_blocks == 8


def test_free_list_order_lru_eviction_and_revival() -> None:
    kv = KVCacheManager(6, 2)
    a = mkseq(0, [1, 2, 3, 4, 5])  # blocks 0,1 registered, block 2 partial
    admit_and_prefill(kv, a)
    kv.free(a)
    # Plain block 2 goes to the head; registered ones to the tail, deepest first.
    assert kv.free_block_ids() == [2, 3, 4, 5, 1, 0]
    b = mkseq(1, [1, 2, 9])  # revives block 0 from the middle of the free list
    assert kv.num_blocks_needed(b, 1) == 2
    assert kv.allocate_prefix(b) == 2
    assert b.block_table == [0]
    assert kv.free_block_ids() == [2, 3, 4, 5, 1]
    assert kv.append_slots(b, 1) and b.block_table == [0, 2]
    # Exhaust the plain blocks; the next allocation evicts block 1 (LRU, registered).
    c = mkseq(2, [7] * 8)
    kv.allocate_prefix(c)
    assert kv.append_slots(c, 8)
    assert c.block_table == [3, 4, 5, 1]
    assert kv.stats().cached_blocks == 1  # block 1's hash was dropped on eviction
    kv.free(b)
    kv.free(c)
    d = mkseq(3, [1, 2, 3, 4, 5])
    assert kv.cached_prefix_tokens(d) == 2  # block 0 still cached, block 1 evicted
    kv.check_invariants()


def test_generated_tokens_are_registered() -> None:
    kv = KVCacheManager(8, 4)
    a = mkseq(0, [1, 2, 3, 4, 5, 6])
    admit_and_prefill(kv, a)
    a.output_token_ids += [7, 8, 9]  # decode: tokens 6, 7 computed one by one
    compute(kv, a, 1)
    compute(kv, a, 1)
    assert kv.stats().cached_blocks == 2  # block 1 = tokens 5..8 (two of them generated)
    b = mkseq(1, [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert kv.cached_prefix_tokens(b) == 8


def test_reuse_disabled() -> None:
    kv = KVCacheManager(8, 4, enable_block_reuse=False)
    a = mkseq(0, list(range(9)))
    admit_and_prefill(kv, a)
    b = mkseq(1, list(range(9)))
    assert admit_and_prefill(kv, b) == 0
    assert b.block_table == [3, 4, 5]
    s = kv.stats()
    assert (s.reuse_hits, s.reuse_misses, s.cached_blocks, s.hit_rate) == (0, 0, 0, 0.0)


def test_chained_hash_depends_on_prefix() -> None:
    assert chain_hashes([1, 2, 3, 4, 5], 2) == [
        block_hash(ROOT_HASH, [1, 2]),
        block_hash(block_hash(ROOT_HASH, [1, 2]), [3, 4]),
    ]
    kv = KVCacheManager(8, 2)
    admit_and_prefill(kv, mkseq(0, [1, 2, 3, 4, 5]))
    # Same second block, different first block: no hit at all.
    assert kv.cached_prefix_tokens(mkseq(1, [9, 9, 3, 4, 5])) == 0


def test_misuse_is_refused() -> None:
    kv = KVCacheManager(4, 4)
    a = mkseq(0, [1, 2, 3])
    with pytest.raises(RuntimeError, match="not admitted"):
        kv.append_slots(a, 1)
    kv.allocate_prefix(a)
    with pytest.raises(RuntimeError, match="already admitted"):
        kv.allocate_prefix(a)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 14), st.booleans()), min_size=1, max_size=40
    )
)
def test_random_admit_and_free_keeps_invariants(ops: list[tuple[int, int, bool]]) -> None:
    """Admit prompts built from 4 shared stems; free at random. Refcounts must equal the
    number of live block tables holding each block, and everything returns to the pool."""
    kv = KVCacheManager(12, 3)
    stems = [[1] * 14, [1] * 6 + [2] * 8, [3] * 14, [1] * 3 + [4] * 11]
    live: list[Sequence] = []
    for rid, (stem, length, free_oldest) in enumerate(ops):
        seq = mkseq(rid, stems[stem][:length])
        if kv.can_allocate(seq, seq.num_tokens - kv.cached_prefix_tokens(seq)):
            admit_and_prefill(kv, seq)
            assert seq.num_computed_tokens == seq.num_tokens
            live.append(seq)
        if free_oldest and live:
            kv.free(live.pop(0))
        kv.check_invariants()
        for b in range(kv.total_blocks):
            assert kv.ref_count(b) == sum(s.block_table.count(b) for s in live)
        assert all(len(set(s.block_table)) == len(s.block_table) for s in live)
    for seq in live:
        kv.free(seq)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.total_blocks


@pytest.mark.parametrize("seed", range(4))
def test_append_blocks_and_register_filled_blocks_equal_the_per_row_methods(seed: int) -> None:
    """``append_blocks`` (a block for each row whose token starts one) makes the tables
    ``append_slots`` makes, and ``register_filled_blocks`` leaves the pool as
    ``register_full_blocks`` does: hashes, the cache map, the memo, counts; also for rows
    outside its common case (prompt blocks pending, shared prompts, a row registered
    twice), which take ``register_full_blocks`` itself."""
    import random

    rng = random.Random(seed)
    pools = [KVCacheManager(400, 4, enable_block_reuse=True) for _ in range(2)]
    seqs = [[], []]
    prompts = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 14))] for _ in range(12)]
    for kv, out in zip(pools, seqs, strict=True):
        for rid, p in enumerate(prompts):
            s = Sequence(rid, list(p), SamplingParams(max_new_tokens=40), 40, 0.0)
            admit_and_prefill(kv, s)
            out.append(s)
    for _ in range(30):
        toks = [rng.randrange(1, 9) for _ in prompts]
        for e, (kv, out) in enumerate(zip(pools, seqs, strict=True)):
            filled = []
            starts = [s for s in out if s.num_computed_tokens % 4 == 0]  # need one block
            if e == 0:
                assert kv.append_blocks(starts) is not None
            for s, t in zip(out, toks, strict=True):
                if e == 1 or s not in starts:
                    assert kv.append_slots(s, 1)
                s.num_computed_tokens += 1
                s.output_token_ids.append(t)
                if s.num_computed_tokens % 4 == 0 or rng.random() < 0.1:
                    filled.append(s)
            if e == 0:
                kv.register_filled_blocks(filled)
            else:
                for s in filled:
                    kv.register_full_blocks(s)
        a, b = pools
        assert a._hash == b._hash and a._cached == b._cached
        assert a._seq_registered == b._seq_registered and a._seq_hashes == b._seq_hashes
        assert [s.block_table for s in seqs[0]] == [s.block_table for s in seqs[1]]
        assert [s.block_table_version for s in seqs[0]] == [s.block_table_version for s in seqs[1]]
        assert a.num_free_blocks == b.num_free_blocks
