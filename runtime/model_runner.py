"""ModelRunner: one engine step on a Backend — flattened tokens in, sampled token ids out.

Per ``step(batch)``:
1. prepare: order the sequences decode-first (one-token sequences first, then the rest in
   batch order), flatten their new tokens with no padding, compute positions, cache slots
   (from each ``seq.block_table``, allocated by the KVCacheManager before the step), the
   sequences' offsets/context lengths/block tables, the rows to sample and the sampling
   columns; stage all of it in one host buffer and send it with ONE host→device copy,
   then copy each section into its static workspace buffer (device-to-device).
2. forward: embed → per layer [norm, qkv, rope + KV write, paged attention, o_proj,
   add+norm, gate_up, silu·mul, down, (add+norm fused with the next layer's norm)] →
   final add+norm → gather the sampled rows → lm_head (embed_tokens when tied) → logits.
   Every op writes into a view of the workspace arena (the memory plan's offsets).
3. sample: ``backend.sample`` → ``sampled_ids``; ONE device→host copy returns the ids (and,
   when a row asked for them, the log-probabilities packed in the same copy).

After ``capture_cuda_graphs()``, decode-only steps (one new token per sequence, plain
sampling) instead replay the CUDA graph of their batch-size bucket
(``llmc.runtime.cuda_graphs``): one staging copy, one graph launch, one copy of the ids.

Invariants: tokens are returned in the batch's order (one per sequence with ``sample``);
the KV-cache tensors (``kv_cache``) are written only at the step's slots; on CUDA the only
synchronisation is the final device→host copy, so ``phase_times['forward']`` measures
launch time there and ``'sample'`` includes waiting for the device. Nothing is allocated on
the device inside a step except torch-internal temporaries of the reference ops and, only
when a row uses them, penalty counts and logprobs (documented in llmc.runtime.sampling).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llmc.compiler.spec import ModelSpec
from llmc.errors import ConfigError, EngineError, RequestError
from llmc.runtime import sampling as smp
from llmc.runtime.backend import AttentionMetadata, Backend, SamplingMetadata
from llmc.runtime.kv_tensors import KVCacheTensors, allocate_kv_cache
from llmc.runtime.rope import cos_sin_tables
from llmc.runtime.types import ScheduledBatch, ScheduledSequence
from llmc.runtime.workspace import (
    TORCH_DTYPES,
    Staging,
    Workspace,
    WorkspaceTable,
    check_table,
    default_table,
    expected_shapes,
)


@dataclass
class StepOutput:
    """Result of one step: one token per sampled sequence, in the batch's order."""

    token_ids: list[int]
    logprobs: list[smp.TokenLogprobs | None] | None = None
    phase_times: dict[str, float] = field(default_factory=dict)
    """Seconds of 'prepare', 'forward' and 'sample'."""


@dataclass
class _StepInputs:
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


class ModelRunner:
    """Runs ScheduledBatches of one model on one Backend from static buffers."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        *,
        backend: Backend,
        device: torch.device | str,
        dtype: str,
        max_num_tokens: int,
        max_batch_size: int,
        max_seq_len: int,
        tokens_per_block: int,
        num_kv_blocks: int,
        workspace: WorkspaceTable | None = None,
    ) -> None:
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype {dtype!r} is not one of float32, float16, bfloat16")
        limits = dict(
            max_num_tokens=max_num_tokens,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            tokens_per_block=tokens_per_block,
            num_kv_blocks=num_kv_blocks,
        )
        for name, v in limits.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        self.spec = spec
        self.backend = backend
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_num_tokens, self.max_batch_size = max_num_tokens, max_batch_size
        self.max_seq_len, self.tokens_per_block = max_seq_len, tokens_per_block
        self.max_blocks_per_seq = -(-max_seq_len // tokens_per_block)
        self.weights = self._load_weights(weights)
        self.kv_cache: KVCacheTensors = allocate_kv_cache(
            spec, num_kv_blocks, tokens_per_block, TORCH_DTYPES[dtype], self.device
        )
        self.cos, self.sin = cos_sin_tables(spec, max_seq_len, self.device)
        shape_args = (spec, dtype, max_num_tokens, max_batch_size, max_seq_len, tokens_per_block)
        table = workspace if workspace is not None else default_table(*shape_args)
        check_table(table, expected_shapes(*shape_args))
        self.workspace = Workspace(table, self.device)
        t, b = max_num_tokens, max_batch_size
        stage_bytes = 8 * (4 * t + 3 * b) + 4 * (2 * b + 1 + b * self.max_blocks_per_seq)
        stage_bytes += 4 * b * (1 + len(smp.FLOAT_COLUMNS)) + 8 * 32
        self.staging = Staging(stage_bytes, self.device)
        pin = self.device.type == "cuda"
        # two read-back buffers: step N+1 may be launched before step N's ids are read
        self._host_ids = torch.empty(2, b, dtype=torch.int64, pin_memory=pin)
        self._launches = 0
        self._unread = 0  # launched steps whose ids were not read back yet
        self.graphs: Any = None  # llmc.runtime.cuda_graphs.DecodeGraphs once captured

    def capture_cuda_graphs(self, buckets: tuple[int, ...] | None = None) -> float:
        """Capture decode-only CUDA graphs per batch-size bucket (default
        ``cuda_graphs.default_buckets``); later decode-only steps replay them. Returns the
        capture time in seconds. Needs a CUDA device and a backend whose launches are
        capturable (the CudaBackend)."""
        from llmc.runtime.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self, buckets)
        graphs.capture()
        self.graphs = graphs
        return graphs.capture_seconds

    # ---- set-up --------------------------------------------------------------------
    def _load_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = self.spec.tensor_shapes()
        dt = TORCH_DTYPES[self.dtype]
        out: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            if name not in weights:
                raise EngineError(f"engine weights: tensor {name!r} is missing")
            w = weights[name]
            if tuple(w.shape) != shape:
                raise EngineError(
                    f"engine weights: tensor {name!r} has shape {list(w.shape)}, "
                    f"expected {list(shape)}"
                )
            out[name] = w.to(device=self.device, dtype=dt).contiguous()
        unexpected = sorted(set(weights) - set(expected))
        if unexpected:
            raise EngineError(f"engine weights: unexpected tensor {unexpected[0]!r}")
        if self.spec.tie_word_embeddings:
            out["lm_head"] = out["embed_tokens"]
        return out

    # ---- prepare -------------------------------------------------------------------
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

    def _prepare(self, batch: ScheduledBatch, src_rows: list[int] | None = None) -> _StepInputs:
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
        return _StepInputs(
            num_tokens=t,
            num_sampled=len(sampled),
            sampled=sampled,
            attn=attn,
            input_ids=static["input_ids"],
            logits_indices=static["logits_indices"],
            sampling=meta,
        )

    # ---- forward -------------------------------------------------------------------
    def _forward(self, inp: _StepInputs) -> torch.Tensor | None:
        """Run the layers; returns logits [S, V] float32 (a workspace view) or None if S = 0."""
        be, w, ws, spec = self.backend, self.weights, self.workspace, self.spec
        t, s = inp.num_tokens, inp.num_sampled
        eps = spec.rms_norm_eps
        nq, hd = spec.num_heads, spec.head_dim
        residual, normed = ws["residual"][:t], ws["normed"][:t]
        qkv, q, attn_out = ws["qkv"][:t], ws["q"][:t], ws["attn_out"][:t]
        proj_out, gate_up, act = ws["proj_out"][:t], ws["gate_up"][:t], ws["act"][:t]
        meta = inp.attn
        be.embedding(inp.input_ids, w["embed_tokens"], out=residual)
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            k_cache, v_cache = self.kv_cache.layer(i)
            if i == 0:
                be.rms_norm(residual, w[p + "input_norm"], eps, out=normed)
            else:  # the previous layer's MLP residual add, fused with this layer's norm
                be.add_rms_norm(proj_out, residual, w[p + "input_norm"], eps, out=normed)
            be.linear(normed, w[p + "qkv_proj"], w.get(p + "qkv_bias"), out=qkv)
            qh = be.rope_and_cache_write(
                qkv,
                meta.positions,
                self.cos,
                self.sin,
                k_cache,
                v_cache,
                meta.slot_mapping,
                out=q,
            )
            be.attention(qh.view(t, nq, hd), k_cache, v_cache, meta, out=attn_out)
            be.linear(attn_out, w[p + "o_proj"], out=proj_out)
            be.add_rms_norm(proj_out, residual, w[p + "post_attn_norm"], eps, out=normed)
            be.linear(normed, w[p + "gate_up_proj"], out=gate_up)
            be.silu_and_mul(gate_up, out=act)
            be.linear(act, w[p + "down_proj"], out=proj_out)
        if s == 0:
            return None
        be.add_rms_norm(proj_out, residual, w["final_norm"], eps, out=normed)
        last_hidden = ws["last_hidden"][:s]
        torch.index_select(normed, 0, inp.logits_indices, out=last_hidden)
        logits = ws["logits"][:s]
        be.linear(last_hidden, w["lm_head"], out=logits)
        return logits

    # ---- public --------------------------------------------------------------------
    def forward_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [S, V] float32 of the sampled rows (batch order); a copy (for tests)."""
        inp = self._prepare(batch)
        logits = self._forward(inp)
        if logits is None:
            return torch.empty(0, self.spec.vocab_size, device=self.device)
        return logits.clone()

    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Compute one step; return the sampled token of each ``sample`` sequence."""
        return self.launch(batch).result()

    def launch(self, batch: ScheduledBatch, src_rows: list[int] | None = None) -> PendingStep:
        """Start one step on the device and return without waiting for its sampled ids.

        ``src_rows`` (async scheduling): a decode-only batch scheduled before the previous
        step's tokens reached the host; row ``i``'s input is row ``src_rows[i]`` of the
        previous step's sampled ids, which stay on the device. At most two launched steps
        may be unread (``PendingStep.result()``) at a time.
        """
        if self._unread >= 2:
            raise EngineError("two launched steps are unread; call result() on the older one")
        if batch.is_empty:
            return PendingStep(self, None, None, {}, token_ids=[])
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.launch(batch, src_rows)
        t0 = time.perf_counter()
        inp = self._prepare(batch, src_rows)
        t1 = time.perf_counter()
        logits = self._forward(inp)
        t2 = time.perf_counter()
        times: dict[str, Any] = {"prepare": t1 - t0, "forward": t2 - t1}
        if logits is None or inp.sampling is None:
            times["sample"] = 0.0
            return PendingStep(self, None, None, times, token_ids=[])
        s, meta = inp.num_sampled, inp.sampling
        ids = self.backend.sample(logits, meta)
        out_ids = self.workspace["sampled_ids"][:s]
        out_ids.copy_(ids)
        if meta.num_logprobs is not None:
            packed = smp.logprob_tensor(logits, meta, out_ids, meta.num_logprobs).cpu().tolist()
            token_ids = [int(row[0]) for row in packed]
            logprobs = smp.unpack_logprobs(packed, [x.seq for x in inp.sampled])
            times["sample"] = time.perf_counter() - t2
            return PendingStep(self, None, None, times, token_ids=token_ids, logprobs=logprobs)
        pending = self.read_back_ids(s, times)
        times["sample"] = time.perf_counter() - t2  # sampling launch; result() adds the wait
        return pending

    def read_back_ids(self, n: int, times: dict[str, Any]) -> PendingStep:
        """Start the device→host copy of the first ``n`` sampled ids (pinned buffer, event)."""
        host = self._host_ids[self._launches % 2, :n]
        self._launches += 1
        src = self.workspace["sampled_ids"][:n]
        if self.device.type == "cuda":
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(src)
            event = None
        self._unread += 1
        return PendingStep(self, host, event, times)


class PendingStep:
    """A launched step: ``result()`` waits for its sampled ids (once) → StepOutput."""

    def __init__(
        self,
        runner: ModelRunner,
        host: torch.Tensor | None,
        event: Any,
        times: dict[str, Any],
        *,
        token_ids: list[int] | None = None,
        logprobs: list[smp.TokenLogprobs | None] | None = None,
    ) -> None:
        self._runner, self._host, self._event = runner, host, event
        self.times = times
        self._out: StepOutput | None = None
        if token_ids is not None:
            self._out = StepOutput(token_ids=token_ids, logprobs=logprobs, phase_times=times)

    def result(self) -> StepOutput:
        if self._out is None:
            t0 = time.perf_counter()
            if self._event is not None:
                self._event.synchronize()
            assert self._host is not None
            ids = self._host.tolist()
            self._runner._unread -= 1
            self.times["sample"] = self.times.get("sample", 0.0) + time.perf_counter() - t0
            self._out = StepOutput(token_ids=ids, phase_times=self.times)
        return self._out
