"""Piecewise CUDA graphs of prefill and mixed steps: the layers' ops between two attentions
captured as one graph per piece and token-count bucket, the attentions launched eagerly.

Why: an eager step launches about a dozen kernels per layer from Python. On the H200's host
an 8,192-token prefill step of the SmolLM2-135M shape spends ~25 ms launching them for ~6 ms
of GPU work (py-spy of `llmc bench`, docs/PERFORMANCE.md 2026-12-02), and the 4,096-request
128/128 row spends a third of its host time there. The attention is what a graph cannot
fix in advance (its grid follows the step's sequences); everything else is row-wise over the
step's tokens, so it is captured for a padded token count (vLLM's piecewise CUDA graphs).

A step runs piecewise (``PiecewiseGraphs.can_run``) when neither the decode nor the prefill
graphs serve it and it has ``T`` tokens with ``max(1, fused_decode_max_tokens) < T <=`` the
largest bucket; it is padded to the smallest bucket ``B >= T``. Its inputs are prepared as
for the eager step (``StepInputBuilder.prepare``: the real rows in the workspace views, the
real AttentionMetadata); then rows ``T..B-1`` of ``slot_mapping`` are set to -1 (the
RoPE/KV-write kernel writes nothing for them) and of ``positions`` to 0 (a row of the RoPE
tables); ``input_ids`` there holds ids an earlier step wrote (valid ids; zeroed at capture).
Replay: piece 0 (embedding, layer 0 up to its attention), then per layer ``i`` its attention
over the real metadata on ``B`` rows (``DecoderLayers.attention``: padding rows come out as
zeros or as they were) and piece ``i + 1`` (the rest of layer ``i``, then layer ``i + 1`` up
to its attention; the last: the rest of the last layer). The head (final norm, the sampled
rows, lm_head) and the sampling run eagerly on the real rows (``ModelRunner.head``), so
every sampling mode, logprobs and prompt logprobs work as in the eager step. Every piece is
row-wise, so padding rows never reach a real row; the real rows get the eager step's ops
(on the GPU a matmul over ``B`` rows may use another cuBLAS kernel than over ``T``: equal to
rounding, as on CPU).

Capture: after the decode and prefill graphs, largest bucket first, into their memory pool;
per bucket one eager warm-up of the pieces, then each piece between ``capture_begin`` and
``capture_end`` on one side stream (no synchronisation or garbage collection per piece).
The pieces' inputs are the workspace views of ``B`` rows (fixed addresses).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from llmc.base.errors import ConfigError
from llmc.cuda.backend import AttentionMetadata
from llmc.runtime.cuda_graphs import smallest_bucket
from llmc.runtime.gc_heap import gc_paused
from llmc.runtime.layers import DecoderLayers
from llmc.runtime.step_inputs import StepInputBuilder, StepInputs

Embed = Callable[[torch.Tensor, int], None]
"""(input ids, rows) → the embeddings in the workspace's ``residual`` (``ModelRunner.embed``)."""


def piecewise_buckets(max_tokens: int, min_tokens: int, budget: int) -> tuple[int, ...]:
    """16, 32, ..., 512, then every 256 tokens, up to ``min(max_tokens, budget)`` (and that
    cap itself), above ``min_tokens`` (the fused small-step path's largest step)."""
    top = min(max_tokens, budget)
    sizes = [16, 32, 64, 128, 256, *range(512, top + 1, 256)]
    out = {b for b in sizes if max(1, min_tokens) < b <= top}
    if top > max(1, min_tokens) and top >= 16:
        out.add(top)
    return tuple(sorted(out))


class PiecewiseGraphs:
    """The captured pieces of the layers per token-count bucket (CUDA backends only)."""

    def __init__(
        self,
        inputs: StepInputBuilder,
        embed: Embed,
        layers: DecoderLayers,
        buckets: tuple[int, ...],
        *,
        allow_cpu: bool = False,
    ) -> None:
        """``allow_cpu``: for tests whose subclass replaces ``_capture_piece``."""
        if inputs.device.type != "cuda" and not allow_cpu:
            raise ConfigError("CUDA graphs need a CUDA device")
        self.min_tokens = int(getattr(layers.backend, "fused_decode_max_tokens", 0))
        most = inputs.limits.max_num_tokens
        bad = [b for b in buckets if not max(1, self.min_tokens) < b <= most]
        if bad:
            raise ConfigError(
                f"piecewise CUDA graph bucket {bad[0]} is outside "
                f"({max(1, self.min_tokens)}, max_num_tokens={most}]"
            )
        if layers.reduce is not None:
            raise ConfigError("piecewise CUDA graphs do not run tensor-parallel layers")
        self.inputs, self.embed, self.layers = inputs, embed, layers
        self.device = inputs.device
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs: dict[int, list[Any]] = {}  # bucket -> its pieces, in replay order
        self.capture_seconds = 0.0
        self.replays = 0

    # ---- capture ---------------------------------------------------------------------
    def _piece_inputs(self, big: int) -> StepInputs:
        """The inputs the pieces of bucket ``big`` are captured on: the workspace views of
        ``big`` rows (the ops between attentions read only input ids, positions and slots;
        the attention metadata's other fields are a placeholder, never used by a piece)."""
        ws, mbs = self.inputs.workspace, self.inputs.limits.max_blocks_per_seq
        attn = AttentionMetadata(
            positions=ws["positions"][:big],
            slot_mapping=ws["slot_mapping"][:big],
            cu_seqlens_q=ws["cu_seqlens_q"][:2],
            seq_lens=ws["seq_lens"][:1],
            block_tables=ws["block_tables"].view(-1)[:mbs].view(1, mbs),
            num_decode_seqs=0,
            max_query_len=big,
            max_seq_len=self.inputs.limits.max_seq_len,
        )
        return StepInputs(
            num_tokens=big,
            num_sampled=0,
            sampled=[],
            attn=attn,
            input_ids=ws["input_ids"][:big],
            logits_indices=ws["logits_indices"][:0],
            sampling=None,
        )

    def clear_rows(self) -> None:
        """Every row of the workspace's input ids, positions and slots valid and inert (id 0,
        position 0, slot -1); steps write only valid values there afterwards."""
        ws = self.inputs.workspace
        ws["input_ids"].zero_()
        ws["positions"].zero_()
        ws["slot_mapping"].fill_(-1)

    def _steps(self, big: int) -> Iterator[int]:
        """The pieces of bucket ``big`` as a generator: each ``next()`` runs one piece."""
        inp = self._piece_inputs(big)
        self.embed(inp.input_ids, big)
        yield from self.layers.pieces(inp, False)

    def capture(self, pool: Any = None) -> None:
        """Warm up and capture every bucket's pieces, largest first, into ``pool`` (the
        decode graphs'; None: a new one)."""
        t0 = time.perf_counter()
        self.clear_rows()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with gc_paused():
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for big in sorted(self.buckets, reverse=True):
                    for _ in self._steps(big):  # eager warm-up (kernel modules, handles)
                        pass
                    side.synchronize()
                    self.graphs[big] = self._capture_pieces(big, pool)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def _capture_pieces(self, big: int, pool: Any) -> list[Any]:
        steps, pieces, more = self._steps(big), [], True
        while more:
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=pool)
            try:
                next(steps)
            except StopIteration:
                more = False
            finally:
                g.capture_end()
            pieces.append(g)
        return pieces

    # ---- replay ----------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def can_run(self, inp: StepInputs) -> bool:
        return bool(self.graphs) and max(1, self.min_tokens) < inp.num_tokens <= self.buckets[-1]

    def run(self, inp: StepInputs) -> None:
        """The layers of a prepared step (``can_run`` true) over its bucket: the pieces'
        graphs with the attentions between them. The caller then runs the head on the
        step's real rows (``ModelRunner.head(inp, fused=False)``)."""
        t = inp.num_tokens
        big = self.bucket_for(t)
        assert big is not None
        ws = self.inputs.workspace
        ws["slot_mapping"][t:big].fill_(-1)
        ws["positions"][t:big].zero_()
        pieces = self.graphs[big]
        pieces[0].replay()
        for i, piece in enumerate(pieces[1:]):
            self.layers.attention(i, inp, big)
            piece.replay()
        self.replays += 1
