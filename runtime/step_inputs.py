"""Step-input preparation: a ScheduledBatch → the device tensors one ModelRunner step reads.

``StepInputBuilder.prepare(batch)`` orders the sequences decode-first (one-token sequences
first, then the rest in batch order), flattens their new tokens with no padding, computes
positions, cache slots (from each ``seq.block_table``, allocated by the KVCacheManager before
the step), the sequences' offsets/context lengths/block tables, the rows to sample, the
sampling columns and the rows that score prompt tokens (``prompt_logprobs.prompt_rows``,
staged last and only when some request asks); stages all of it in one host buffer
(``staging``) and sends it with ONE host→device copy, then copies each section into its
static workspace buffer (device-to-device). ``decode_rows`` is the vectorised (numpy) row
building of a decode-only batch, shared with the CUDA-graph path
(``llmc.runtime.cuda_graphs``).

Invariants: every batch is checked against the run's ``EngineLimits`` (max_num_tokens,
max_batch_size, max_seq_len, block tables, vocabulary) before anything is staged, and a bad
one raises ConfigError / EngineError naming the step, or a RequestFault (a RequestError) naming
the one request whose data is wrong (the Executor fails that request alone); the staging
sections are added in a fixed order (the CUDA graphs rely on the layout staying the same);
the returned tensors are views of the static workspace, valid until the next step.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmc.base.errors import ConfigError, EngineError, RequestError
from llmc.compiler.limits import EngineLimits
from llmc.compiler.spec import ModelSpec
from llmc.cuda.backend import AttentionMetadata, SamplingMetadata
from llmc.runtime import prompt_logprobs as plp
from llmc.runtime import sampling as smp
from llmc.runtime.decode_row_cache import DecodeRowCache
from llmc.runtime.slot_columns import SlotColumns
from llmc.runtime.step_mixed import flatten, mixed_rows
from llmc.runtime.types import RequestFault, ScheduledBatch, ScheduledSequence, Sequence
from llmc.runtime.workspace import Staging, Workspace

_SEQ = operator.attrgetter("seq")
_START = operator.attrgetter("start_position")
_NEW = operator.attrgetter("num_new_tokens")
_SAMPLE = operator.attrgetter("sample")
_VERSION = operator.attrgetter("block_table_version")
_OUT = operator.attrgetter("output_token_ids")
_PARAMS = operator.attrgetter("sampling")
_LAST = operator.itemgetter(-1)
_NOT_PLAIN = "step {}: async scheduling does not serve penalties or logprobs"


@dataclass
class StepInputs:
    """One step's prepared inputs (workspace views) for ``ModelRunner._forward``."""

    num_tokens: int
    num_sampled: int
    sampled: list[ScheduledSequence]
    attn: AttentionMetadata
    input_ids: torch.Tensor
    logits_indices: torch.Tensor
    sampling: SamplingMetadata | None
    prompt: plp.PromptRows | None = None
    """The rows that score prompt tokens (``prompt_logprobs``), None in most steps."""


class StepInputBuilder:
    """Checks, flattens and stages ScheduledBatches into a runner's static workspace."""

    def __init__(
        self,
        spec: ModelSpec,
        workspace: Workspace,
        device: torch.device,
        limits: EngineLimits,
    ) -> None:
        self.spec, self.workspace, self.device = spec, workspace, device
        self.limits = limits
        t, b, nb = limits.max_num_tokens, limits.max_batch_size, limits.max_blocks_per_seq
        stage_bytes = 8 * (4 * t + 3 * b) + 4 * (2 * b + 1 + b * nb)
        stage_bytes += 4 * b * (1 + len(smp.FLOAT_COLUMNS)) + 8 * 32
        stage_bytes += 16 * t  # prompt-logprob rows and targets
        self.staging = Staging(stage_bytes, device)
        self.row_cache = DecodeRowCache(2 * b + 64, nb)
        self.slot_columns = SlotColumns()  # the columns of decode rows over slots

    def _check(self, batch: ScheduledBatch) -> None:
        lim = self.limits
        if batch.num_tokens > lim.max_num_tokens:
            raise ConfigError(
                f"step {batch.step_id}: {batch.num_tokens} tokens exceed max_num_tokens "
                f"({lim.max_num_tokens})"
            )
        if len(batch.sequences) > lim.max_batch_size:
            raise ConfigError(
                f"step {batch.step_id}: {len(batch.sequences)} sequences exceed max_batch_size "
                f"({lim.max_batch_size})"
            )
        for s in batch.sequences:
            rid, end = s.seq.request_id, s.start_position + s.num_new_tokens
            if s.num_new_tokens <= 0 or s.start_position < 0 or end > s.seq.num_tokens:
                raise RequestFault(
                    rid,
                    f"scheduled tokens [{s.start_position}, {end}) are not "
                    f"within its {s.seq.num_tokens} known tokens",
                )
            if end > lim.max_seq_len:
                raise RequestFault(
                    rid, f"position {end - 1} is beyond max_seq_len ({lim.max_seq_len})"
                )
            if len(s.seq.block_table) * lim.tokens_per_block < end:
                raise RequestFault(
                    rid,
                    f"block table of {len(s.seq.block_table)} blocks cannot hold "
                    f"{end} tokens (tokens_per_block={lim.tokens_per_block})",
                )

    def prefill_row(
        self, batch: ScheduledBatch
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, positions, cache slots [T] int64, block table [nb] int32) of a step
        whose one sequence takes a chunk of T new tokens (the prefill CUDA graphs'), checked
        as ``prepare`` checks a batch (RequestFault naming a request whose tokens, positions
        or blocks are out of range)."""
        self._check(batch)
        (ss,) = batch.sequences
        flat_ids, positions, slots = flatten([ss], self.limits.tokens_per_block)
        self._check_vocab(flat_ids, [ss], [0, len(flat_ids)])
        end = ss.start_position + ss.num_new_tokens
        table = ss.seq.block_table[: -(-end // self.limits.tokens_per_block)]
        return flat_ids, positions, slots, np.asarray(table, dtype=np.int32)

    def decode_rows(
        self, batch: ScheduledBatch, src_rows: Seq[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, positions, cache slots, source rows [b] int64, block tables [b, nb]
        int32) of a decode-only batch, in batch order, checked.

        With ``src_rows`` (async scheduling) a row with ``src_rows[i] >= 0`` takes the token
        the previous step sampled into row ``src_rows[i]`` of its ``sampled_ids``: not known
        on the host yet, so the row's position is the sequence's ``num_tokens`` and its
        staged id is 0; a row with -1 has its token on the host (``Scheduler.schedule_ahead``
        scheduled it from known tokens)."""
        return self.decode_step(batch, src_rows)[0]

    def decode_step(
        self,
        batch: ScheduledBatch,
        src_rows: Seq[int] | None = None,
        span: np.ndarray | None = None,
    ) -> tuple[
        tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        dict[str, np.ndarray],
        np.ndarray,
    ]:
        """(``decode_rows``' rows, the rows' sampling columns as numpy arrays keyed like
        ``sampling.sampling_columns``, per-row "plain sampling" flags [b] bool: no
        penalty, no logprobs). Per-sequence state comes from the slot arrays when the batch
        has slot rows (``ScheduledBatch.rows``: ``valid``, or ``valid_ahead`` with
        ``src_rows``), else from ``row_cache``.

        ``span`` [b] int64 (a multi-step window): each row's block table covers its next
        ``span[i]`` positions, whose blocks the scheduler reserved
        (``Scheduler.plan_window``); positions, slots and columns are the first step's."""
        sched = batch.sequences
        b = len(sched)
        if b > self.limits.max_batch_size or b > self.limits.max_num_tokens:
            self._check(batch)
        ahead = src_rows is not None
        if isinstance(src_rows, range):  # (ahead_src_rows: the same rows, in order)
            if len(src_rows) != b or (b and src_rows[0] < 0):
                raise EngineError(f"step {batch.step_id}: src_rows must give a row per sequence")
            src = np.arange(src_rows.start, src_rows.stop, src_rows.step, dtype=np.int64)
        elif ahead:
            src = np.asarray(src_rows, dtype=np.int64).reshape(-1)
            if len(src) != b or (b and int(src.min()) < -1):
                raise EngineError(
                    f"step {batch.step_id}: src_rows must give a row >= -1 per sequence"
                )
        else:
            src = np.full(b, -1, dtype=np.int64)
        fed = src >= 0  # the rows whose token the previous step samples (on the device)
        mixed = ahead and not bool(fed.all())  # some rows' tokens are on the host
        slot_rows = batch.rows  # decode rows over the scheduler's slot arrays
        if slot_rows is not None and (  # a row left (or went stale): the objects decide
            slot_rows.state.width < self.row_cache.width
            or mixed
            or not (slot_rows.valid_ahead(b) if ahead else slot_rows.valid(b))
        ):
            slot_rows = None
        if slot_rows is None:
            seqs = list(map(_SEQ, sched))
            outs = list(map(_OUT, seqs))
            p = np.fromiter(map(_START, sched), dtype=np.int64, count=b)
            new_ok = np.fromiter(map(_NEW, sched), dtype=np.int64, count=b) == 1
            nout = np.fromiter(map(len, outs), dtype=np.int64, count=b)
            versions = np.fromiter(map(_VERSION, seqs), dtype=np.int64, count=b)
            cols_of = self.row_cache
            rows = cache_rows = cols_of.rows(seqs, versions)
            have = cols_of.filled[rows]  # blocks of each table (up to max_blocks_per_seq)
            known = cols_of.prompt_len[rows] + nout
            tables = cols_of.table
        else:  # one new token each, by construction; ahead: num_out lacks the token in
            # flight, which is this row's input (its position is ``start``)
            st, rows = slot_rows.state, slot_rows.slots
            seqs, p, new_ok = slot_rows.seqs, slot_rows.start, True
            nout, have, tables = st.num_out[rows], st.blocks[rows], st.table
            known = st.prompt_len[rows] + nout
            cols_of = self.slot_columns
            cache_rows = cols_of.rows(slot_rows)
        tpb = self.limits.tokens_per_block
        if span is not None:  # the window's last position of each row
            nblk = (p + span - 1) // tpb + 1
        else:
            nblk = p // tpb + 1
        if not ahead:
            rows_ok = (p >= 0) & (p < known)
        elif mixed:
            rows_ok = np.where(fed, p == known, (p >= 0) & (p < known))
        else:
            rows_ok = p == known
        ok = bool((rows_ok & new_ok & (p < self.limits.max_seq_len) & (have >= nblk)).all())
        if not ok:
            if ahead:
                raise RequestError(
                    f"step {batch.step_id}: an async-scheduled row is not the next token of its "
                    "sequence, lacks its block or exceeds max_seq_len"
                )
            self._check(batch)  # raises the precise error
            raise EngineError(f"step {batch.step_id}: a decode row has more than one new token")
        if mixed:  # the host's tokens where it knows them, 0 where the device feeds them
            ids = np.zeros(b, dtype=np.int64)
            own = np.flatnonzero(~fed)
            ids[own] = [seqs[i].token_at(int(p[i])) for i in own.tolist()]
            if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
                self._check_vocab(ids, sched, list(range(b + 1)))
        elif ahead:
            ids = np.zeros(b, dtype=np.int64)
        elif bool((p == known - 1).all() and (nout > 0).all()):
            if slot_rows is not None:
                ids = slot_rows.state.last[rows]
            else:
                ids = np.fromiter(map(_LAST, outs), dtype=np.int64, count=b)
        else:
            ids = np.fromiter(map(Sequence.token_at, seqs, p.tolist()), dtype=np.int64, count=b)
        if b and not ahead and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
            self._check_vocab(ids, sched, list(range(b + 1)))
        blk = p // tpb
        nb = int(nblk.max()) if b else 1
        table = tables[rows, :nb]
        if bool((have > nblk).any()):
            table[np.arange(nb) >= nblk[:, None]] = -1
        slots = tables[rows, blk].astype(np.int64) * tpb + p % tpb  # (blk < nblk: unmasked)
        cols = {
            "seeds": cols_of.seed[cache_rows],
            "offsets": nout + fed,  # a fed row's offset counts the token in flight
            "top_k": cols_of.top_k[cache_rows],
        }
        floats = cols_of.floats[cache_rows]
        for j, name in enumerate(smp.FLOAT_COLUMNS):
            cols[name] = floats[:, j]
        return (ids, p, slots, src, table), cols, cols_of.plain[cache_rows]

    def _check_vocab(self, flat_ids: np.ndarray, order: Any, cu: list[int]) -> None:
        if flat_ids.size and (flat_ids.min() < 0 or flat_ids.max() >= self.spec.vocab_size):
            rows = np.nonzero((flat_ids < 0) | (flat_ids >= self.spec.vocab_size))[0]
            bad = order[int(np.searchsorted(cu, rows[0], side="right")) - 1]
            raise RequestFault(
                bad.seq.request_id, f"token id outside the vocabulary [0, {self.spec.vocab_size})"
            )

    def gather_input_ids(self, out: torch.Tensor, staged: torch.Tensor, src: torch.Tensor) -> None:
        """out = staged ids, except rows with ``src >= 0``: the previous step's sampled id of
        row ``src`` (device-side; capturable in a CUDA graph)."""
        prev = self.workspace["sampled_ids"].index_select(0, src.clamp(min=0))
        torch.where(src >= 0, prev, staged, out=out)

    def place(
        self,
        dev: dict[str, torch.Tensor],
        b: int,
        nb: int,
        num_decode: int,
        max_query: int,
        max_seq_len: int,
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
        """Uploaded sections ``dev`` → their static workspace buffers (``src_rows``: the
        previous step's ids) and the AttentionMetadata of ``b`` sequences, tables [b, nb];
        also a tensor-parallel follower's, on the sections rank 0 broadcast."""
        ws, static = self.workspace, {}
        for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
            if name not in dev:
                continue
            static[name] = ws[name][: dev[name].shape[0]]
            if name == "input_ids" and "src_rows" in dev:
                self.gather_input_ids(static[name], dev[name], dev["src_rows"])
            else:
                static[name].copy_(dev[name])
        for name in ("cu_seqlens_q", "seq_lens"):
            static[name] = ws[name][: dev[name].shape[0]]
            static[name].copy_(dev[name])
        bt = ws["block_tables"].view(-1)[: b * nb].view(b, nb)
        bt.copy_(dev["block_tables"].view(b, nb))
        attn = AttentionMetadata(
            positions=static["positions"],
            slot_mapping=static["slot_mapping"],
            cu_seqlens_q=static["cu_seqlens_q"],
            seq_lens=static["seq_lens"],
            block_tables=bt,
            num_decode_seqs=num_decode,
            max_query_len=max_query,
            max_seq_len=max_seq_len,
            partial_out=ws["attn_partial_out"],
            partial_lse=ws["attn_partial_lse"],
        )
        return static, attn

    def prepare(
        self,
        batch: ScheduledBatch,
        src_rows: Seq[int] | None = None,
        span: np.ndarray | None = None,
    ) -> StepInputs:
        """Check ``batch``, stage its inputs (one host→device copy) and copy them into the
        static workspace; ``src_rows`` as in ``decode_rows`` (async scheduling), ``span``
        as in ``decode_step`` (a multi-step window's decode-only batch)."""
        seqs = list(batch.sequences)
        if span is not None or set(map(_NEW, seqs)) <= {1}:
            order = seqs
            rows, dcols, plain = self.decode_step(batch, src_rows, span)
            flat_ids, positions, slots, src, tables = rows
            b = len(order)
            nb = tables.shape[1]
            cu = np.arange(b + 1, dtype=np.int32)
            seq_lens = positions + 1
            flags = np.fromiter(map(_SAMPLE, seqs), dtype=bool, count=b)
            sampled = list(itertools.compress(seqs, flags.tolist()))
            logits_rows = np.nonzero(flags)[0]
            if src_rows is not None and not bool(plain[flags & (src >= 0)].all()):
                raise EngineError(_NOT_PLAIN.format(batch.step_id))
            cols = {name: col[flags] for name, col in dcols.items()}
            all_plain = bool(plain[flags].all())
            num_decode, max_query = b, 1
            # a row that samples nothing is a one-token chunk of a prompt: it may score one
            prompt = None if len(sampled) == b else plp.prompt_rows(order, range(b))
        else:
            m = mixed_rows(self, batch, seqs, src_rows)
            order, flat_ids, positions, slots, cu = m.order, m.ids, m.positions, m.slots, m.cu
            seq_lens, tables, sampled, logits_rows = m.seq_lens, m.tables, m.sampled, m.logits_rows
            cols, num_decode, all_plain, src = m.cols, m.num_one, m.all_plain, m.src
            if not m.fed_plain:
                raise EngineError(_NOT_PLAIN.format(batch.step_id))
            b, nb = len(order), tables.shape[1]
            max_query = max(map(_NEW, order))
            prompt = plp.prompt_rows(order, cu.tolist())
        st = self.staging
        st.begin()
        st.add("input_ids", flat_ids, "int64")
        if src_rows is not None:
            st.add("src_rows", src, "int64")
        st.add("positions", positions, "int64")
        st.add("slot_mapping", slots, "int64")
        st.add("logits_indices", logits_rows, "int64")
        st.add("cu_seqlens_q", cu, "int32")
        st.add("seq_lens", seq_lens, "int32")
        st.add("block_tables", tables.reshape(-1), "int32")
        for name, dt in smp.COLUMN_DTYPES.items():
            st.add(name, cols[name], dt)
        if prompt is not None:  # last: the sections before keep the CUDA graphs' layout
            st.add("prompt_rows", prompt.rows, "int64")
            st.add("prompt_targets", prompt.targets, "int64")
        dev = st.upload()
        if prompt is not None:
            prompt.index, prompt.target_ids = dev["prompt_rows"], dev["prompt_targets"]
        static, attn = self.place(dev, b, nb, num_decode, max_query, int(max(seq_lens)))
        meta = None
        if sampled:
            greedy = bool((cols["temperature"] == 0).all())  # (the sampler reads this column)
            meta = smp.build_metadata(
                dev, [s.seq for s in sampled], self.spec.vocab_size, self.device, all_plain, greedy
            )
        return StepInputs(
            num_tokens=len(flat_ids),
            num_sampled=len(sampled),
            sampled=sampled,
            attn=attn,
            input_ids=static["input_ids"],
            logits_indices=static["logits_indices"],
            sampling=meta,
            prompt=prompt,
        )
