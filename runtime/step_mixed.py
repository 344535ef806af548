"""A step with prompt chunks → its rows in staging order (``mixed_rows``), for
``StepInputBuilder.prepare`` (runtime/step_inputs.py): the one-token rows first, through the
builder's ``decode_step`` (over the slot arrays when they are the batch's ``prefix_rows``),
then the chunks per sequence (``flatten``); with ``src_rows`` (async scheduling) a one-token
row may take its token from the previous step's ids on the device, a chunk never does.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import numpy as np

from llmc.base.errors import EngineError
from llmc.runtime import sampling as smp
from llmc.runtime.types import ScheduledBatch, ScheduledSequence

_NEW = operator.attrgetter("num_new_tokens")
_START = operator.attrgetter("start_position")


class MixedRows(NamedTuple):
    """The rows of a step with prompt chunks (``mixed_rows``), in staging order:
    its one-token rows first (batch order), then its chunks (batch order)."""

    order: list[ScheduledSequence]
    ids: np.ndarray  # [T] int64, and positions, slots likewise
    positions: np.ndarray
    slots: np.ndarray
    cu: np.ndarray  # [b + 1] int64: each row's first flat token
    seq_lens: np.ndarray  # [b] int64
    tables: np.ndarray  # [b, nb] int32, -1 beyond a row's blocks
    sampled: list[ScheduledSequence]  # the rows that sample, in batch order
    logits_rows: np.ndarray  # their last flat token each
    cols: dict[str, np.ndarray]  # their sampling columns, in the staged dtypes
    num_one: int  # one-token rows (the attention's decode rows)
    all_plain: bool  # every sampled row ``is_plain``
    src: np.ndarray | None  # [T] int64 with ``src_rows``: each token's source row, or -1
    fed_plain: bool  # every row fed from the previous step's ids ``is_plain``


def flatten(order: list[ScheduledSequence], tpb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, positions, cache slots) [T] int64 of the sequences' new tokens, in order
    (one-token rows first, as ``order`` has them): one Python pass gathers each row's
    tokens and the blocks its positions fall in, numpy does the rest."""
    toks: list[Any] = []  # each row's new token ids
    blocks: list[Any] = []  # each row's blocks from its first position's to its last's
    a_list: list[int] = []
    n_list: list[int] = []
    for s in order:
        seq, a, n = s.seq, s.start_position, s.num_new_tokens
        p = seq.prompt_token_ids
        toks.append(p[a : a + n] if a + n <= len(p) else seq.all_token_ids[a : a + n])
        blocks.append(seq.block_table[a // tpb : (a + n - 1) // tpb + 1])
        a_list.append(a)
        n_list.append(n)
    lens = np.asarray(n_list, dtype=np.int64)
    total = int(lens.sum())
    chain = itertools.chain.from_iterable
    ids = np.fromiter(chain(toks), dtype=np.int64, count=total)
    starts = np.asarray(a_list, dtype=np.int64)
    first = np.cumsum(lens) - lens  # each row's first flat index
    positions = np.arange(total, dtype=np.int64) + np.repeat(starts - first, lens)
    nblk = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))
    flat_blocks = np.fromiter(chain(blocks), dtype=np.int64, count=int(nblk.sum()))
    # a position's block: its row's first listed block + (its block - its row's first block)
    base = np.repeat(np.cumsum(nblk) - nblk - starts // tpb, lens)
    slots = flat_blocks[base + positions // tpb] * tpb + positions % tpb
    return ids, positions, slots


def mixed_rows(
    builder: Any,
    batch: ScheduledBatch,
    seqs: list[ScheduledSequence],
    src_rows: Seq[int] | None = None,
) -> MixedRows:
    """The rows of a step with prompt chunks, checked by ``builder`` (a
    ``StepInputBuilder``): its one-token rows through
    ``decode_step`` (over the slot arrays when they are the batch's ``prefix_rows``,
    else over ``row_cache``), the chunks per sequence. ``src_rows`` (async scheduling,
    per row of ``seqs``) as in ``decode_rows``; a chunk's tokens are the host's (-1)."""
    lim, tpb = builder.limits, builder.limits.tokens_per_block
    if len(seqs) > lim.max_batch_size or batch.num_tokens > lim.max_num_tokens:
        builder._check(batch)  # raises the step's error
    # the prefix rows (``prefix_rows``: decode rows, every one sampled) lead the batch:
    # only the rows after them are looked at one by one
    pre = batch.prefix_rows
    k = len(pre.seqs) if pre is not None else 0
    tail = seqs[k:]
    one = seqs[:k]
    one_at = list(range(k))  # (each one-token row's index in ``seqs``)
    for i, s in enumerate(tail, k):
        if s.num_new_tokens == 1:
            one.append(s)
            one_at.append(i)
    chunks = [s for s in tail if s.num_new_tokens != 1]
    nd, order = len(one), one + chunks
    src_one = None
    if src_rows is not None:
        src_all = np.asarray(src_rows, dtype=np.int64).reshape(-1)
        if len(src_all) != len(seqs):
            raise EngineError(f"step {batch.step_id}: src_rows must give a row per sequence")
        src_one = src_all[one_at]
        if int(src_all.max(initial=-1)) >= 0 and bool((np.delete(src_all, one_at) >= 0).any()):
            raise EngineError(
                f"step {batch.step_id}: a prompt chunk cannot take its token from the "
                "previous step's ids"
            )
    d_plain = np.zeros(0, dtype=bool)
    if one:
        # the prefix's rows are all the one-token rows when as many
        whole = pre is not None and k == nd
        sub = ScheduledBatch(batch.step_id, tuple(one), rows=pre if whole else None)
        rows, d_cols, d_plain = builder.decode_step(sub, src_one)
        d_ids, d_pos, d_slots, _, d_table = rows
    else:
        d_ids = d_pos = d_slots = np.zeros(0, dtype=np.int64)
        d_table, d_cols = np.zeros((0, 1), dtype=np.int32), {}
    builder._check(ScheduledBatch(batch.step_id, tuple(chunks)))
    c_ids, c_pos, c_slots = flatten(chunks, tpb)
    lens = np.fromiter(map(_NEW, chunks), dtype=np.int64, count=len(chunks))
    c_cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    builder._check_vocab(c_ids, chunks, c_cu.tolist())
    c_lens = np.fromiter(map(_START, chunks), dtype=np.int64, count=len(chunks)) + lens
    cu = np.concatenate([np.arange(nd, dtype=np.int64), nd + c_cu])
    seq_lens = np.concatenate([d_pos + 1, c_lens])
    nblk = -(-seq_lens // tpb)
    tables = np.full((len(order), int(nblk.max())), -1, dtype=np.int32)
    tables[:nd, : d_table.shape[1]] = d_table
    for i, s in enumerate(chunks):
        blocks = s.seq.block_table[: int(nblk[nd + i])]
        tables[nd + i, : len(blocks)] = blocks
    # sampled rows, in batch order, and their rows in ``order``: the prefix's first
    where = {id(s): i for i, s in enumerate(order[k:], k)}
    t_sampled = [s for s in tail if s.sample]
    sampled = seqs[:k] + t_sampled
    at = np.concatenate([
        np.arange(k, dtype=np.int64),
        np.fromiter((where[id(s)] for s in t_sampled), dtype=np.int64, count=len(t_sampled)),
    ])  # fmt: skip
    is_one = at < nd
    c_seqs = [s.seq for s in itertools.compress(sampled, (~is_one).tolist())]
    c_cols = smp.sampling_columns(c_seqs)
    all_plain = bool(d_plain[at[is_one]].all()) and all(s.sampling.is_plain for s in c_seqs)
    cols: dict[str, np.ndarray] = {}
    for name, dtype in smp.COLUMN_DTYPES.items():
        cols[name] = col = np.empty(len(sampled), dtype=dtype)
        col[~is_one] = c_cols[name]
        if nd:
            col[is_one] = d_cols[name][at[is_one]]
    flat = [np.concatenate(x) for x in ((d_ids, c_ids), (d_pos, c_pos), (d_slots, c_slots))]
    src = fed_plain = None
    if src_one is not None:
        src = np.concatenate([src_one, np.full(len(c_ids), -1, dtype=np.int64)])
        fed_plain = bool(d_plain[src_one >= 0].all())
    return MixedRows(
        order,
        *flat,
        cu,
        seq_lens,
        tables,
        sampled,
        cu[1:][at] - 1,
        cols,
        nd,
        all_plain,
        src,
        fed_plain is not False,
    )
