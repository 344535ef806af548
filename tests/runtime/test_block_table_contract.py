"""The KVCacheManager ↔ step-inputs contract, in code: every change of a sequence's block
table bumps ``block_table_version`` (a reset — admission, free — also sets
``block_table_reset_version``), and the decode row cache re-reads a table exactly when its
version changed: appended blocks only after an append, the whole table after a reset.
A changed table is never missed (also a same-length replacement, also in the same list
object); an unchanged one is not re-read."""

from __future__ import annotations

import numpy as np

from helpers.fakes import fake_parts
from helpers.runner import make_runner
from llmc.runtime.decode_row_cache import DecodeRowCache
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.types import SamplingParams, ScheduledBatch, ScheduledSequence, Sequence


def mkseq(rid: int, n_prompt: int, max_new: int = 8) -> Sequence:
    prompt = [10 + rid * 100 + i for i in range(n_prompt)]
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return Sequence(rid, prompt, sp, max_new, 0.0)


def versions(seq: Sequence) -> tuple[int, int]:
    return seq.block_table_version, seq.block_table_reset_version


def test_every_table_change_bumps_the_version() -> None:
    kv = KVCacheManager(8, 4)
    a = mkseq(0, 6)
    assert versions(a) == (0, 0)
    kv.allocate_prefix(a)
    assert versions(a) == (1, 1)  # admission: a reset
    assert kv.append_slots(a, 6) and a.block_table == [0, 1]
    assert versions(a) == (2, 1)  # appended
    a.num_computed_tokens = 6
    assert kv.append_slots(a, 2) and versions(a) == (2, 1)  # room in its block: unchanged
    assert not kv.append_slots(a, 40) and versions(a) == (2, 1)  # refused: unchanged
    kv.free(a)
    assert a.block_table == [] and versions(a) == (3, 3)  # freed: a reset


def test_preemption_resets_the_victims_table() -> None:
    parts = fake_parts(num_blocks=6, max_num_tokens=32, max_batch_size=4, policy="max_utilization")
    s = parts.scheduler
    a, b = mkseq(0, 8, max_new=12), mkseq(1, 8, max_new=10)
    s.add(a)
    s.add(b)
    while True:
        before = versions(b)
        batch = s.schedule()
        if batch.preempted_request_ids:
            break
        s.update(batch, [5] * sum(x.sample for x in batch.sequences))
    assert batch.preempted_request_ids == (1,)
    assert b.block_table == [] and versions(b)[1] == versions(b)[0] > before[0]


def _cache_with(seq: Sequence) -> tuple[DecodeRowCache, int]:
    cache = DecodeRowCache(4, 6)
    [r] = cache.rows([seq], np.array([seq.block_table_version]))
    return cache, int(r)


def _row(cache: DecodeRowCache, r: int) -> list[int]:
    return cache.table[r, : cache.filled[r]].tolist()


def test_row_cache_rereads_exactly_the_changed_tables(monkeypatch) -> None:
    kv = KVCacheManager(16, 4)
    a = mkseq(0, 6)
    kv.allocate_prefix(a)
    kv.append_slots(a, 6)
    cache, r = _cache_with(a)
    assert _row(cache, r) == a.block_table == [0, 1]
    copies: list[int] = []
    copy = DecodeRowCache._copy_blocks
    monkeypatch.setattr(
        DecodeRowCache,
        "_copy_blocks",
        lambda self, row, seq: (copies.append(row), copy(self, row, seq)),
    )

    def step() -> list[int]:
        cache.rows([a], np.array([a.block_table_version]))
        return _row(cache, r)

    for _ in range(3):  # unchanged: never re-read
        assert step() == [0, 1]
    assert copies == []
    a.num_computed_tokens = 8
    kv.append_slots(a, 1)  # an appended block: only the new entry is copied
    cache.table[r, 0] = 99  # (a stale entry the append must not touch)
    assert step() == [99, 1, 2] and copies == [r]
    cache.table[r, 0] = 0
    copies.clear()
    # same length, same list object, new blocks: the version is all that says so
    a.block_table[:] = [7, 8, 9]
    a.block_table_version += 1
    a.block_table_reset_version = a.block_table_version
    assert step() == [7, 8, 9] and copies == [r]
    # a list changed behind the manager's back (no new version) is not re-read
    a.block_table[0] = 5
    assert step() == [7, 8, 9] and copies == [r]


def test_decode_rows_after_preemption_and_recompute_use_the_new_table(
    tiny_llama_weights,
) -> None:
    """A preempted sequence comes back with a table of the same length in other blocks; the
    next decode step's block table and slots are the new ones."""
    spec, weights = tiny_llama_weights
    runner = make_runner(spec, weights, tokens_per_block=4, num_kv_blocks=32)
    kv = KVCacheManager(32, 4, enable_block_reuse=False)
    a, other = mkseq(0, 6), mkseq(1, 6)
    for seq in (a, other):
        kv.allocate_prefix(seq)
        kv.append_slots(seq, 6)
        seq.num_computed_tokens, seq.output_token_ids = 6, [3]

    def decode_tables() -> tuple[np.ndarray, np.ndarray]:
        batch = ScheduledBatch(0, tuple(ScheduledSequence(s, 6, 1, True) for s in (a, other)))
        _, _, slots, _, tables = runner.inputs.decode_rows(batch)
        return tables, slots

    tables, _ = decode_tables()
    assert tables.tolist() == [a.block_table, other.block_table] == [[0, 1], [2, 3]]
    kv.free(a)  # preempted; re-admitted (recompute) into other blocks of the same count
    kv.allocate_prefix(a)
    blocker = mkseq(2, 4)
    kv.allocate_prefix(blocker)
    kv.append_slots(blocker, 4)  # takes a's old first block
    kv.append_slots(a, 7)
    a.num_computed_tokens = 6
    assert len(a.block_table) == 2 and a.block_table != [0, 1]
    tables, slots = decode_tables()
    assert tables.tolist() == [a.block_table, other.block_table]
    assert slots.tolist()[0] == a.block_table[1] * 4 + 2
