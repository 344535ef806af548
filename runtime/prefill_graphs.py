"""CUDA graphs of one-sequence prefill steps: one graph per token-count bucket.

Why: an eager step launches about a dozen kernels per layer from Python, so on an idle
engine the host's launches, not the GPU's work, set the time to first token (a 128-token
prompt: ~10 ms of launches on the Llama-3-8B shape for ~4 ms of GPU work). A step that the
graphs serve costs one staging copy, one graph launch and the copy of its sampled id.

Eligible (``PrefillGraphs.can_run``): a step of exactly one sequence whose chunk of ``T``
new tokens, ``max(1, min_tokens) < T <=`` the largest bucket (``min_tokens``: the fused
small-step path's largest step; a one-token step is a decode step, the decode graphs'),
ends its prompt (the row is sampled), with plain sampling (``SamplingParams.is_plain``),
no prompt logprobs, no branching and no multi-step window. It runs as the graph of the
smallest bucket ``B >= T``:

- rows ``T..B-1`` are padding: token 0 at position 0, cache slot -1 (the RoPE/KV-write
  kernel skips it). The attention kernels read the real query length from
  ``cu_seqlens_q = [0, T]`` (padding rows: zeros or left as they were); every other op
  works row by row, so padding rows (whatever the workspace held) never reach a real row,
  the KV cache or the sampled row;
- the attention launch grid is fixed at capture by ``max_query_len = B`` (the kernels skip
  tiles past a sequence's query length, as they do for the shorter sequences of any
  prefill batch); ``seq_lens = [start + T]``; the block table row is padded with -1 to
  ``max_blocks_per_seq``; ``logits_indices = [T - 1]``; the row's sampling columns.

The real rows get the eager step's values: the same ops (every bucket is above the fused
small-step path's ``fused_decode_max_tokens``, so both take the unfused layer sequence); on
the GPU a matmul over ``B`` rows may run another cuBLAS kernel than over ``T`` rows, so
agreement is to rounding (CPU matmuls too block by row count). Graphs are captured after the decode
graphs, largest bucket first, into the decode graphs' memory pool (one pool; steps never
run concurrently).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from llmc.base.errors import ConfigError, EngineError
from llmc.cuda.backend import AttentionMetadata, Backend
from llmc.runtime import sampling as smp
from llmc.runtime.cuda_graphs import (
    Forward,
    Layout,
    sampling_metadata,
    smallest_bucket,
    stage_columns,
    staged_layout,
)
from llmc.runtime.gc_heap import gc_paused
from llmc.runtime.step_inputs import StepInputBuilder, StepInputs
from llmc.runtime.types import ScheduledBatch

DEFAULT_MAX_TOKENS = 512
"""Largest prefill graph bucket by default (``--prefill_graph_max_tokens``)."""


def prefill_buckets(max_tokens: int, min_tokens: int, budget: int) -> tuple[int, ...]:
    """Powers of two from 16 up to ``min(max_tokens, budget)`` that are above ``min_tokens``
    (the fused small-step path's largest step), plus that cap when it is not one."""
    top = min(max_tokens, budget)
    out = [b for b in (16, 32, 64, 128, 256, 512, 1024, 2048) if min_tokens < b <= top]
    if top > min_tokens and top >= 16 and top not in out:
        out.append(top)
    return tuple(sorted(out))


class PrefillGraphs:
    """Captured one-sequence prefill graphs over one StepInputBuilder, forward and backend
    (CUDA backends only)."""

    def __init__(
        self,
        inputs: StepInputBuilder,
        forward: Forward,
        backend: Backend,
        buckets: tuple[int, ...],
        *,
        allow_cpu: bool = False,
    ) -> None:
        """``allow_cpu``: for tests whose subclass replaces ``capture``."""
        if inputs.device.type != "cuda" and not allow_cpu:
            raise ConfigError("CUDA graphs need a CUDA device")
        self.min_tokens = int(getattr(backend, "fused_decode_max_tokens", 0))
        bad = [b for b in buckets if not self.min_tokens < b <= inputs.limits.max_num_tokens]
        if bad:
            raise ConfigError(
                f"prefill CUDA graph bucket {bad[0]} is outside "
                f"({self.min_tokens}, max_num_tokens={inputs.limits.max_num_tokens}]"
            )
        self.inputs, self.forward, self.backend = inputs, forward, backend
        self.device = inputs.device
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._layout: dict[int, Layout] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    # ---- staging ---------------------------------------------------------------------
    def _stage(
        self,
        big: int,
        row: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None,
        cols: dict[str, Any] | None,
    ) -> dict[str, torch.Tensor]:
        """Stage ``big`` padded token rows of one sequence: ``row`` = (token ids,
        positions, slots, block table, seq_len) of its ``T`` new tokens and ``cols`` its
        sampling columns, or None (capture: an all-padding step, layout recorded)."""
        mbs = self.inputs.limits.max_blocks_per_seq
        t = 0 if row is None else len(row[0])
        st = self.inputs.staging
        st.begin()
        for name, i, pad in (("input_ids", 0, 0), ("positions", 1, 0), ("slot_mapping", 2, -1)):
            view = st.reserve(name, big, "int64")
            if t:
                view[:t] = row[i]  # type: ignore[index]
            view[t:] = pad
        st.reserve("logits_indices", 1, "int64")[0] = max(t - 1, 0)
        cu = st.reserve("cu_seqlens_q", 2, "int32")
        cu[0], cu[1] = 0, t
        st.reserve("seq_lens", 1, "int32")[0] = 0 if row is None else row[4]
        table = st.reserve("block_tables", mbs, "int32")
        table[:] = -1
        if row is not None:
            table[: len(row[3])] = row[3]
        stage_columns(st, 1, 0 if cols is None else 1, cols or smp.sampling_columns([]))
        dev = st.upload()
        layout = staged_layout(dev)
        if row is None:
            self._layout[big] = layout
        elif layout != self._layout[big]:
            raise EngineError(
                f"prefill CUDA graph bucket {big}: staging layout changed since capture"
            )
        return dev

    def _body(self, big: int, dev: dict[str, torch.Tensor]) -> None:
        """What one graph computes (also run eagerly as the warm-up)."""
        ws, mbs = self.inputs.workspace, self.inputs.limits.max_blocks_per_seq
        for name in ("input_ids", "positions", "slot_mapping"):
            ws[name][:big].copy_(dev[name])
        for name, n in (("logits_indices", 1), ("cu_seqlens_q", 2), ("seq_lens", 1)):
            ws[name][:n].copy_(dev[name])
        bt = ws["block_tables"].view(-1)[:mbs].view(1, mbs)
        bt.copy_(dev["block_tables"].view(1, mbs))
        attn = AttentionMetadata(
            positions=ws["positions"][:big],
            slot_mapping=ws["slot_mapping"][:big],
            cu_seqlens_q=ws["cu_seqlens_q"][:2],
            seq_lens=ws["seq_lens"][:1],
            block_tables=bt,
            num_decode_seqs=0,
            max_query_len=big,
            max_seq_len=self.inputs.limits.max_seq_len,
            partial_out=ws["attn_partial_out"],
            partial_lse=ws["attn_partial_lse"],
        )
        meta = sampling_metadata(dev)
        inp = StepInputs(
            num_tokens=big,
            num_sampled=1,
            sampled=[],
            attn=attn,
            input_ids=ws["input_ids"][:big],
            logits_indices=ws["logits_indices"][:1],
            sampling=meta,
        )
        logits = self.forward(inp)
        assert logits is not None
        ws["sampled_ids"][:1].copy_(self.backend.sample(logits, meta))

    # ---- capture ---------------------------------------------------------------------
    def capture(self, pool: Any = None) -> None:
        """Warm up and capture every bucket, largest first, into ``pool`` (the decode
        graphs'; None: a new one). The backend's scratch must be reserved already (the
        decode graphs' capture reserves it)."""
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with gc_paused():
            for big in sorted(self.buckets, reverse=True):
                dev = self._stage(big, None, None)
                self._body(big, dev)  # eager warm-up: kernel modules, cuBLAS workspaces
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._body(big, dev)
                self.graphs[big] = g
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    # ---- replay ----------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def can_run(self, batch: ScheduledBatch) -> bool:
        if not self.graphs or len(batch.sequences) != 1 or batch.window is not None:
            return False
        ss = batch.sequences[0]
        params = ss.seq.sampling
        return (
            ss.sample
            and max(1, self.min_tokens) < ss.num_new_tokens <= self.buckets[-1]
            and not batch.branching
            and params.prompt_logprobs is None
            and params.is_plain
        )

    def stage(self, batch: ScheduledBatch) -> int:
        """Stage an eligible step (``can_run``) for its bucket's graph; returns the bucket."""
        ids, positions, slots, table = self.inputs.prefill_row(batch)
        ss = batch.sequences[0]
        big = self.bucket_for(len(ids))
        assert big is not None
        cols = smp.sampling_columns([ss.seq])
        self._stage(big, (ids, positions, slots, table, ss.start_position + len(ids)), cols)
        return big

    def replay(self, big: int) -> None:
        """Launch bucket ``big``'s graph on what ``stage`` staged; the sampled id lands in
        row 0 of the workspace's ``sampled_ids`` (the caller reads it back)."""
        self.graphs[big].replay()
        self.replays += 1
