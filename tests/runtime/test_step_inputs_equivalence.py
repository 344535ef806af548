"""Decode-step staging equals the implementation before the incremental row cache.

``StepInputBuilder.prepare`` and ``DecodeGraphs._stage`` (fed by ``decode_step``) must stage
the same bytes, section by section, as the reference below (the code of commit 412483b:
rows rebuilt from each sequence's Python lists every step), for batches produced by the
real Scheduler + KVCacheManager: staggered arrivals, shared prefixes (block reuse), chunked
prefill, preemption (max_utilization, few blocks), cancellation, async ``schedule_ahead``
steps, and sampling params with seeds, top-k, penalties and logprobs. Bad batches must
raise the same error class and message.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from helpers.fakes import make_scheduler
from helpers.runner import make_runner
from llmc.base.errors import EngineError, RequestError
from llmc.runtime import sampling as smp
from llmc.runtime.admission import GUARANTEED_NO_EVICT, MAX_UTILIZATION
from llmc.runtime.cuda_graphs import _PAD_COLUMN, DecodeGraphs, graph_eligible
from llmc.runtime.decode_row_cache import DecodeRowCache
from llmc.runtime.types import FinishReason, SamplingParams, ScheduledBatch, Sequence

TPB = 4


# ---- reference: the staging code before the row cache ------------------------------------
def _flatten(order, tpb):
    """(ids, positions, slots) of the rows' new tokens, one row at a time (the flattening of
    commit 412483b)."""
    ids, positions, slots = [], [], []
    for s in order:
        seq, a, n = s.seq, s.start_position, s.num_new_tokens
        for p in range(a, a + n):
            ids.append(seq.token_at(p))
            positions.append(p)
            slots.append(seq.block_table[p // tpb] * tpb + p % tpb)
    return tuple(np.asarray(x, dtype=np.int64) for x in (ids, positions, slots))


def ref_decode_rows(self, batch, src_rows=None):
    seqs = batch.sequences
    b = len(seqs)
    if b > self.limits.max_batch_size or b > self.limits.max_num_tokens:
        self._check(batch)
    ahead = src_rows is not None
    srcs = list(src_rows) if ahead else [-1] * b  # -1: the row's token is on the host
    tok, pos, tables, ok = [], [], [], True
    for s, r in zip(seqs, srcs, strict=True):
        seq, a = s.seq, s.start_position
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        if r >= 0:
            ok &= a == known and s.num_new_tokens == 1
            tok.append(0)
        else:
            ok &= 0 <= a < known and s.num_new_tokens == 1
            tok.append(seq.token_at(a) if ok else 0)
        pos.append(a)
        tables.append(seq.block_table)
    tpb = self.limits.tokens_per_block
    p = np.asarray(pos, dtype=np.int64)
    nblk = p // tpb + 1
    have = np.fromiter((len(t) for t in tables), dtype=np.int64, count=b)
    ids = np.asarray(tok, dtype=np.int64)
    ok = ok and bool((p < self.limits.max_seq_len).all() and (have >= nblk).all())
    vocab_ok = not (b and (ids.min() < 0 or ids.max() >= self.spec.vocab_size))
    if not (ok and vocab_ok):
        if ahead and not ok:
            raise RequestError(
                f"step {batch.step_id}: an async-scheduled row is not the next token of its "
                "sequence, lacks its block or exceeds max_seq_len"
            )
        if not ahead:
            self._check(batch)
        self._check_vocab(ids, batch.sequences, list(range(b + 1)))
    nb = int(nblk.max()) if b else 1
    table = np.full((b, nb), -1, dtype=np.int32)
    mask = np.arange(nb) < nblk[:, None]
    table[mask] = np.fromiter(
        itertools.chain.from_iterable(t[:k] for t, k in zip(tables, nblk.tolist(), strict=True)),
        dtype=np.int32,
        count=int(nblk.sum()),
    )
    slots = table[np.arange(b), p // tpb].astype(np.int64) * tpb + p % tpb
    src = np.asarray(srcs, dtype=np.int64)
    return ids, p, slots, src, table


def ref_prepare_stage(self, batch, src_rows=None):
    seqs = list(batch.sequences)
    tpb = self.limits.tokens_per_block
    fed = {id(s) for s, r in zip(seqs, src_rows or (), strict=False) if r >= 0}
    if all(s.num_new_tokens == 1 for s in seqs):
        order = seqs
        flat_ids, positions, slots, src, tables = ref_decode_rows(self, batch, src_rows)
        b = len(order)
        cu = np.arange(b + 1, dtype=np.int32)
        seq_lens = positions + 1
        last_row = {id(s): i for i, s in enumerate(order)}
    else:
        self._check(ScheduledBatch(batch.step_id, tuple(s for s in seqs if id(s) not in fed)))
        order = [s for s in seqs if s.num_new_tokens == 1]
        order += [s for s in seqs if s.num_new_tokens != 1]
        flat_ids, positions, slots = _flatten([s for s in order if id(s) not in fed], tpb)
        src = None
        if src_rows is not None:  # rows fed from the device lead ``order``: id 0, src row
            k = sum(id(s) in fed for s in order)
            assert all(id(s) in fed for s in order[:k])
            head = ref_decode_rows(self, ScheduledBatch(batch.step_id, tuple(order[:k])),
                                   [src_rows[seqs.index(s)] for s in order[:k]])  # fmt: skip
            flat_ids, positions, slots = (
                np.concatenate([h, x])
                for h, x in zip(head[:3], (flat_ids, positions, slots), strict=True)
            )
            src = np.concatenate([head[3], np.full(len(flat_ids) - k, -1, dtype=np.int64)])
        cu, seq_lens, last_row = [0], [], {}
        for s in order:
            last_row[id(s)] = cu[-1] + s.num_new_tokens - 1
            cu.append(cu[-1] + s.num_new_tokens)
            seq_lens.append(s.start_position + s.num_new_tokens)
        self._check_vocab(flat_ids, order, cu)
        b = len(order)
        nb = max(-(-n // tpb) for n in seq_lens)
        tables = np.full((b, nb), -1, dtype=np.int32)
        for i, s in enumerate(order):
            blocks = s.seq.block_table[: -(-seq_lens[i] // tpb)]
            tables[i, : len(blocks)] = blocks
    sampled = [s for s in seqs if s.sample]
    if any(
        s.seq.sampling.logprobs is not None or s.seq.sampling.uses_penalties
        for s in sampled
        if id(s) in fed
    ):
        raise EngineError(
            f"step {batch.step_id}: async scheduling does not serve penalties or logprobs"
        )
    st = self.staging
    st.begin()
    st.add("input_ids", flat_ids, "int64")
    if src is not None and src_rows is not None:
        st.add("src_rows", src, "int64")
    st.add("positions", positions, "int64")
    st.add("slot_mapping", slots, "int64")
    st.add("logits_indices", [last_row[id(s)] for s in sampled], "int64")
    st.add("cu_seqlens_q", cu, "int32")
    st.add("seq_lens", seq_lens, "int32")
    st.add("block_tables", tables.reshape(-1), "int32")
    # a row fed from the device counts the token in flight in its sampling offset
    cols = [smp.sampling_columns([s.seq for s in sampled], k) for k in (0, 1)]
    for names, dt in (
        (smp.INT64_COLUMNS, "int64"),
        (smp.INT32_COLUMNS, "int32"),
        (smp.FLOAT_COLUMNS, "float32"),
    ):
        for name in names:
            st.add(name, [cols[id(s) in fed][name][i] for i, s in enumerate(sampled)], dt)


def ref_graph_stage(graphs, big, batch, src_rows):
    r = graphs.inputs
    mbs = r.limits.max_blocks_per_seq
    tok, p, sl, sr, bt = ref_decode_rows(r, batch, src_rows)
    b = len(tok)
    ids = np.zeros(big, dtype=np.int64)
    pos = np.zeros(big, dtype=np.int64)
    slots = np.full(big, -1, dtype=np.int64)
    src = np.full(big, -1, dtype=np.int64)
    lens = np.zeros(big, dtype=np.int32)
    tables = np.full((big, mbs), -1, dtype=np.int32)
    ids[:b], pos[:b], slots[:b], src[:b], lens[:b] = tok, p, sl, sr, p + 1
    tables[:b, : bt.shape[1]] = bt
    both = [smp.sampling_columns([s.seq for s in batch.sequences], k) for k in (0, 1)]
    cols = {n: [both[int(f)][n][i] for i, f in enumerate(sr >= 0)] for n in both[0]}
    st = r.staging
    st.begin()
    for name, arr, dt in (
        ("input_ids", ids, "int64"),
        ("src_rows", src, "int64"),
        ("positions", pos, "int64"),
        ("slot_mapping", slots, "int64"),
        ("seq_lens", lens, "int32"),
        ("block_tables", tables.reshape(-1), "int32"),
    ):
        st.add(name, arr, dt)
    for names, dt in (
        (smp.INT64_COLUMNS, "int64"),
        (smp.INT32_COLUMNS, "int32"),
        (smp.FLOAT_COLUMNS, "float32"),
    ):
        for name in names:
            st.add(name, cols[name] + [_PAD_COLUMN[name]] * (big - b), dt)


# ---- comparison ------------------------------------------------------------------------
def _snapshot(st) -> list[tuple[str, int, bytes]]:
    return [
        (name, n, bytes(st._np[off : off + n * dt.itemsize])) for name, off, n, dt in st._sections
    ]


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error itself is compared
        return ("error", type(e).__name__, str(e))
    return ("ok", None, None)


def _compare(runner, graphs, batch: ScheduledBatch, src_rows) -> int:
    st = runner.inputs.staging
    new = _outcome(lambda: runner.inputs.prepare(batch, src_rows))
    new_bytes = _snapshot(st) if new[0] == "ok" else None
    ref = _outcome(lambda: ref_prepare_stage(runner.inputs, batch, src_rows))
    assert new == ref, (new, ref)
    if new[0] == "ok":
        assert new_bytes == _snapshot(st)
    if not graph_eligible(batch):
        return 0
    big = graphs.bucket_for(len(batch.sequences))
    extra = 0 if src_rows is None else 1
    rows, cols, _ = runner.inputs.decode_step(batch, src_rows)
    graphs._stage(big, rows, [], extra, cols)
    got = _snapshot(st)
    ref_graph_stage(graphs, big, batch, src_rows)
    assert got == _snapshot(st)
    return 1


def _params(rng: random.Random, max_new: int) -> SamplingParams:
    kind = rng.random()
    kw: dict = {"max_new_tokens": max_new, "ignore_eos": True}
    if kind < 0.3:
        kw["temperature"] = 0.0
    elif kind < 0.92:
        kw.update(temperature=rng.choice([0.5, 0.7, 1.3]), top_k=rng.choice([0, 5, 40]))
        kw.update(top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]))
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(-(2**40), 2**63)
    elif kind < 0.96:
        kw.update(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
    else:
        kw["logprobs"] = 2
    return SamplingParams(**kw)


@pytest.mark.parametrize(
    ("seed", "policy", "num_blocks"),
    [(0, MAX_UTILIZATION, 28), (1, GUARANTEED_NO_EVICT, 60), (2, MAX_UTILIZATION, 40)],
)
@pytest.mark.parametrize("small_cache", [False, True])
def test_staging_equals_reference_on_scheduler_batches(
    tiny_llama_weights, seed, policy, num_blocks, small_cache
):
    spec, weights = tiny_llama_weights
    rng = random.Random(seed)
    mbs, mnt = 12, 48
    runner = make_runner(
        spec,
        weights,
        max_batch_size=mbs,
        max_num_tokens=mnt,
        max_seq_len=96,
        tokens_per_block=TPB,
        num_kv_blocks=num_blocks,
    )
    graphs = DecodeGraphs(runner.inputs, runner.forward, runner.backend, allow_cpu=True)
    if small_cache:  # rows run out every few batches: the cache starts over
        runner.inputs.row_cache = DecodeRowCache(mbs + 3, runner.limits.max_blocks_per_seq)
    sched = make_scheduler(
        num_blocks,
        policy=policy,
        max_num_tokens=mnt,
        max_batch_size=mbs,
        max_seq_len=96,
        max_input_len=60,
        tokens_per_block=TPB,
    )
    prefixes = [[rng.randrange(spec.vocab_size) for _ in range(n)] for n in (8, 13, 21)]
    rid = itertools.count()
    stats = dict.fromkeys(("decode", "mixed", "ahead", "ahead_mixed", "graph"), 0)
    stats.update(preempted=0, cancelled=0)

    def arrive(n: int) -> None:
        for _ in range(n):
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            tail = [rng.randrange(spec.vocab_size) for _ in range(rng.randrange(1, 20))]
            max_new = rng.randrange(1, 40)
            r = next(rid)
            sched.add(Sequence(r, head + tail, _params(rng, max_new), max_new, 0.0))

    arrive(6)
    batch, src = sched.schedule(), None
    for _ in range(200):
        if not batch.sequences:
            if not sched.has_unfinished():
                arrive(rng.randrange(1, 6))
            batch, src = sched.schedule(), None
            continue
        if src is None:  # an ahead batch was compared when scheduled, before ``update``
            stats["graph"] += _compare(runner, graphs, batch, src)
        if src is None:
            stats["decode" if batch.num_tokens == len(batch.sequences) else "mixed"] += 1
        ahead = sched.schedule_ahead(batch) if rng.random() < 0.6 else None
        ahead_src = None
        if ahead is not None:
            row = {id(s.seq): i for i, s in enumerate(s for s in batch.sequences if s.sample)}
            ahead_src = [row.get(id(s.seq), -1) for s in ahead.sequences]  # -1: host tokens
            stats["ahead_mixed"] += ahead.num_tokens > len(ahead.sequences)
            stats["graph"] += _compare(runner, graphs, ahead, ahead_src)
            stats["ahead"] += 1
        n_sampled = sum(1 for s in batch.sequences if s.sample)
        sched.update(batch, [rng.randrange(spec.vocab_size) for _ in range(n_sampled)])
        if rng.random() < 0.12:  # (also while steps run ahead: they admit arrivals)
            arrive(rng.randrange(1, 4))
        if ahead is not None:
            batch, src = ahead, ahead_src
            continue
        if rng.random() < 0.08 and sched.running:
            victim = rng.choice(sched.running)
            sched.finish(victim.request_id, FinishReason.CANCELLED)
            stats["cancelled"] += 1
        batch, src = sched.schedule(), None
    stats["preempted"] = sched.stats().num_preemptions
    assert stats["decode"] > 10 and stats["mixed"] > 10 and stats["graph"] > 10, stats
    assert stats["ahead"] > 10 and stats["cancelled"] > 0, stats
    assert stats["ahead_mixed"] > 3, stats  # steps ahead with prompt chunks (admissions)
    assert stats["preempted"] > 0 or policy == GUARANTEED_NO_EVICT, stats
    assert not small_cache or next(rid) > 2 * (mbs + 3)  # more sequences than rows, twice
