"""Step-input preparation: a ScheduledBatch → the device tensors one ModelRunner step reads.

``StepInputBuilder.prepare(batch)`` orders the sequences decode-first (one-token sequences
first, then the rest in batch order), flattens their new tokens with no padding, computes
positions, cache slots (from each ``seq.block_table``, allocated by the KVCacheManager before
the step), the sequences' offsets/context lengths/block tables, the rows to sample and the
sampling columns; stages all of it in one host buffer (``staging``) and sends it with ONE
host→device copy, then copies each section into its static workspace buffer
(device-to-device). ``decode_rows`` is the vectorised (numpy) row building of a decode-only
batch, shared with the CUDA-graph path (``llmc.runtime.cuda_graphs``).

Invariants: every batch is checked against the runner's limits (max_num_tokens,
max_batch_size, max_seq_len, block tables, vocabulary) before anything is staged, and a bad
one raises ConfigError / RequestError / EngineError naming the step or request; the staging
sections are added in a fixed order (the CUDA graphs rely on the layout staying the same);
the returned tensors are views of the static workspace, valid until the next step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmc.compiler.spec import ModelSpec
from llmc.errors import ConfigError, EngineError, RequestError
from llmc.runtime import sampling as smp
from llmc.runtime.backend import AttentionMetadata, SamplingMetadata
from llmc.runtime.types import ScheduledBatch, ScheduledSequence
from llmc.runtime.workspace import Staging, Workspace


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


def _flatten(order: list[ScheduledSequence], tpb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, positions, cache slots) [T] int64 of the sequences' new tokens, in order."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for s in order:
        seq, a, n = s.seq, s.start_position, s.num_new_tokens
        if n == 1:  # decode fast path: plain ints
            ids.append(seq.token_at(a))
            positions.append(a)
            slots.append(seq.block_table[a // tpb] * tpb + a % tpb)
            continue
        p = seq.prompt_token_ids
        toks = p[a : a + n] if a + n <= len(p) else seq.all_token_ids[a : a + n]
        pos = np.arange(a, a + n, dtype=np.int64)
        table = np.asarray(seq.block_table[: -(-(a + n) // tpb)], dtype=np.int64)
        chunks.append((np.asarray(toks, dtype=np.int64), pos, table[pos // tpb] * tpb + pos % tpb))
    # decode rows come first in ``order``, so the plain-int part precedes the chunks
    parts = [np.asarray(x, dtype=np.int64) for x in (ids, positions, slots)]
    if not chunks:
        return parts[0], parts[1], parts[2]
    return tuple(  # type: ignore[return-value]
        np.concatenate([parts[i], *(c[i] for c in chunks)]) for i in range(3)
    )


class StepInputBuilder:
    """Checks, flattens and stages ScheduledBatches into a runner's static workspace."""

    def __init__(
        self,
        spec: ModelSpec,
        workspace: Workspace,
        device: torch.device,
        *,
        max_num_tokens: int,
        max_batch_size: int,
        max_seq_len: int,
        tokens_per_block: int,
    ) -> None:
        self.spec, self.workspace, self.device = spec, workspace, device
        self.max_num_tokens, self.max_batch_size = max_num_tokens, max_batch_size
        self.max_seq_len, self.tokens_per_block = max_seq_len, tokens_per_block
        self.max_blocks_per_seq = -(-max_seq_len // tokens_per_block)
        t, b = max_num_tokens, max_batch_size
        stage_bytes = 8 * (4 * t + 3 * b) + 4 * (2 * b + 1 + b * self.max_blocks_per_seq)
        stage_bytes += 4 * b * (1 + len(smp.FLOAT_COLUMNS)) + 8 * 32
        self.staging = Staging(stage_bytes, device)

    def _check(self, batch: ScheduledBatch) -> None:
        if batch.num_tokens > self.max_num_tokens:
            raise ConfigError(
                f"step {batch.step_id}: {batch.num_tokens} tokens exceed max_num_tokens "
                f"({self.max_num_tokens})"
            )
        if len(batch.sequences) > self.max_batch_size:
            raise ConfigError(
                f"step {batch.step_id}: {len(batch.sequences)} sequences exceed max_batch_size "
                f"({self.max_batch_size})"
            )
        for s in batch.sequences:
            rid, end = s.seq.request_id, s.start_position + s.num_new_tokens
            if s.num_new_tokens <= 0 or s.start_position < 0 or end > s.seq.num_tokens:
                raise RequestError(
                    f"request {rid}: scheduled tokens [{s.start_position}, {end}) are not "
                    f"within its {s.seq.num_tokens} known tokens"
                )
            if end > self.max_seq_len:
                raise RequestError(
                    f"request {rid}: position {end - 1} is beyond max_seq_len ({self.max_seq_len})"
                )
            if len(s.seq.block_table) * self.tokens_per_block < end:
                raise RequestError(
                    f"request {rid}: block table of {len(s.seq.block_table)} blocks cannot hold "
                    f"{end} tokens (tokens_per_block={self.tokens_per_block})"
                )

    def decode_rows(
        self, batch: ScheduledBatch, src_rows: list[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, positions, cache slots, source rows [b] int64, block tables [b, nb]
        int32) of a decode-only batch, in batch order, checked.

        With ``src_rows`` (async scheduling) every row's token is the one the previous step
        sampled into row ``src_rows[i]`` of its ``sampled_ids``: not known on the host yet,
        so the row's position is the sequence's ``num_tokens`` and its staged id is 0."""
        seqs = batch.sequences
        b = len(seqs)
        if b > self.max_batch_size or b > self.max_num_tokens:
            self._check(batch)
        ahead = src_rows is not None
        if ahead and (len(src_rows) != b or min(src_rows, default=0) < 0):
            raise EngineError(f"step {batch.step_id}: src_rows must give a row >= 0 per sequence")
        tok: list[int] = []
        pos: list[int] = []
        tables: list[list[int]] = []
        ok = True
        for s in seqs:
            seq, a = s.seq, s.start_position
            out = seq.output_token_ids
            known = len(seq.prompt_token_ids) + len(out)
            if ahead:
                ok &= a == known and s.num_new_tokens == 1
                tok.append(0)
            else:
                ok &= 0 <= a < known and s.num_new_tokens == 1
                tok.append(seq.token_at(a) if ok else 0)
            pos.append(a)
            tables.append(seq.block_table)
        tpb = self.tokens_per_block
        p = np.asarray(pos, dtype=np.int64)
        nblk = p // tpb + 1
        have = np.fromiter((len(t) for t in tables), dtype=np.int64, count=b)
        ids = np.asarray(tok, dtype=np.int64)
        ok = ok and bool((p < self.max_seq_len).all() and (have >= nblk).all())
        ok = ok and not (b and (ids.min() < 0 or ids.max() >= self.spec.vocab_size))
        if not ok:
            if ahead:
                raise RequestError(
                    f"step {batch.step_id}: an async-scheduled row is not the next token of its "
                    "sequence, lacks its block or exceeds max_seq_len"
                )
            self._check(batch)  # raises the precise error
            self._check_vocab(ids, batch.sequences, list(range(b + 1)))
        nb = int(nblk.max()) if b else 1
        table = np.full((b, nb), -1, dtype=np.int32)
        mask = np.arange(nb) < nblk[:, None]
        table[mask] = np.fromiter(
            itertools.chain.from_iterable(
                t[:k] for t, k in zip(tables, nblk.tolist(), strict=True)
            ),
            dtype=np.int32,
            count=int(nblk.sum()),
        )
        slots = table[np.arange(b), p // tpb].astype(np.int64) * tpb + p % tpb
        src = np.asarray(src_rows if ahead else [-1] * b, dtype=np.int64)
        return ids, p, slots, src, table

    def _check_vocab(self, flat_ids: np.ndarray, order: Any, cu: list[int]) -> None:
        if flat_ids.size and (flat_ids.min() < 0 or flat_ids.max() >= self.spec.vocab_size):
            rows = np.nonzero((flat_ids < 0) | (flat_ids >= self.spec.vocab_size))[0]
            bad = order[int(np.searchsorted(cu, rows[0], side="right")) - 1]
            raise RequestError(
                f"request {bad.seq.request_id}: token id outside the vocabulary "
                f"[0, {self.spec.vocab_size})"
            )

    def gather_input_ids(self, out: torch.Tensor, staged: torch.Tensor, src: torch.Tensor) -> None:
        """out = staged ids, except rows with ``src >= 0``: the previous step's sampled id of
        row ``src`` (device-side; capturable in a CUDA graph)."""
        prev = self.workspace["sampled_ids"].index_select(0, src.clamp(min=0))
        torch.where(src >= 0, prev, staged, out=out)

    def prepare(self, batch: ScheduledBatch, src_rows: list[int] | None = None) -> StepInputs:
        """Check ``batch``, stage its inputs (one host→device copy) and copy them into the
        static workspace; ``src_rows`` as in ``decode_rows`` (async scheduling)."""
        seqs = list(batch.sequences)
        tpb = self.tokens_per_block
        if src_rows is not None or all(s.num_new_tokens == 1 for s in seqs):
            order = seqs
            flat_ids, positions, slots, src, tables = self.decode_rows(batch, src_rows)
            b = len(order)
            nb = tables.shape[1]
            cu = np.arange(b + 1, dtype=np.int32)
            seq_lens = positions + 1
            last_row = {id(s): i for i, s in enumerate(order)}
        else:
            self._check(batch)
            order = [s for s in seqs if s.num_new_tokens == 1]
            order += [s for s in seqs if s.num_new_tokens != 1]
            flat_ids, positions, slots = _flatten(order, tpb)
            src = None
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
        if src_rows is not None and any(
            s.seq.sampling.logprobs is not None or smp.uses_penalties(s.seq.sampling)
            for s in sampled
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
        cols = smp.sampling_columns([s.seq for s in sampled], 1 if src_rows is not None else 0)
        for name in smp.INT64_COLUMNS:
            st.add(name, cols[name], "int64")
        for name in smp.INT32_COLUMNS:
            st.add(name, cols[name], "int32")
        for name in smp.FLOAT_COLUMNS:
            st.add(name, cols[name], "float32")
        dev = st.upload()
        ws = self.workspace
        t = len(flat_ids)
        static = {}
        for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
            n = dev[name].shape[0]
            static[name] = ws[name][:n]
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
            num_decode_seqs=sum(1 for s in order if s.num_new_tokens == 1),
            max_query_len=max(s.num_new_tokens for s in order),
            max_seq_len=int(max(seq_lens)),
            partial_out=ws["attn_partial_out"],
            partial_lse=ws["attn_partial_lse"],
        )
        meta = None
        if sampled:
            meta = smp.build_metadata(
                dev, [s.seq for s in sampled], self.spec.vocab_size, self.device
            )
        return StepInputs(
            num_tokens=t,
            num_sampled=len(sampled),
            sampled=sampled,
            attn=attn,
            input_ids=static["input_ids"],
            logits_indices=static["logits_indices"],
            sampling=meta,
        )
