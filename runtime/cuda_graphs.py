"""CUDA graphs of decode-only steps: one graph per batch-size bucket, replayed by ModelRunner.

A decode-only step (every sequence has exactly one new token and is sampled, plain
sampling: ``SamplingParams.is_plain``) of ``b`` sequences runs as the graph of the
smallest bucket ``B >= b``. ``DecodeGraphs`` gets its collaborators at construction, each
through its public interface: the step-input builder (``StepInputBuilder``: the staging
buffer, the static workspace buffers, the decode rows and the device-side token gather),
the forward callable (``ModelRunner.forward``: prepared inputs → logits) and the backend
(``sample``; ``reserve`` when it has one). It knows nothing of the ModelRunner, which
reads the sampled ids back itself. The graph's inputs are fixed addresses:

- the step's host inputs are staged by ``StepInputBuilder.staging`` in a fixed section
  order with every section padded to ``B`` rows, so the sections' device addresses (in
  the staging mirror) are the same at capture and at every replay (checked per replay
  against the views ``Staging.upload`` returns);
- inside the graph they are copied into the workspace views (input_ids, positions,
  slot_mapping, seq_lens, block_tables with the full ``max_blocks_per_seq`` stride,
  constant cu_seqlens_q = 0..B and logits_indices = 0..B-1), then the forward,
  ``backend.sample`` and the copy into ``sampled_ids`` run.

Padding rows: token 0 at position 0, cache slot -1 (the RoPE/KV-write kernel skips it),
seq_len 0 (the attention kernels write zeros for it), block table row of -1, greedy
neutral sampling columns; their sampled ids are never read back.

Multi-step decoding (``ScheduledBatch.window``): with a ``WindowState``, each bucket also
gets a graph of ``WindowState.advance`` over its staged inputs; a window of K steps is K
times (the bucket's graph, its advance graph) and one copy of the ids
(``llmc.runtime.decode_window``).

Invariants: graphs are captured largest bucket first into ONE memory pool, after an eager
warm-up of each bucket (module loads, cuBLAS handles) and after ``backend.reserve`` (the
backend's scratch is allocated outside the graphs). A replay does one host→device copy
(staging), one graph launch and, by the runner, one device→host copy of the ``b`` sampled
ids; nothing is allocated on the device. Flash-decoding splits are fixed per bucket at
capture for ``max_seq_len`` (the kernel divides each sequence's actual context among them).
"""

from __future__ import annotations

import bisect
import operator
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from llmc.base.errors import ConfigError, EngineError
from llmc.cuda.backend import AttentionMetadata, Backend, SamplingMetadata
from llmc.runtime import sampling as smp
from llmc.runtime.decode_window import WindowState
from llmc.runtime.gc_heap import gc_paused
from llmc.runtime.step_inputs import StepInputBuilder, StepInputs
from llmc.runtime.types import ScheduledBatch
from llmc.runtime.workspace import Staging

_NEW = operator.attrgetter("num_new_tokens")
_SAMPLE = operator.attrgetter("sample")
_PARAMS = operator.attrgetter("seq.sampling")

# neutral value of each sampling column for padding rows
_PAD_COLUMN = {
    "seeds": 0,
    "offsets": 0,
    "top_k": 0,
    "temperature": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def stage_columns(st: Staging, big: int, b: int, cols: dict[str, Any]) -> None:
    """Stage the sampling columns of ``b`` rows, padded to ``big`` rows with each column's
    neutral value (``_PAD_COLUMN``), in SamplingMetadata's section order."""
    for name, dt in smp.COLUMN_DTYPES.items():
        view = st.reserve(name, big, dt)
        view[:b] = cols[name]
        view[b:] = _PAD_COLUMN[name]


def sampling_metadata(dev: dict[str, torch.Tensor]) -> SamplingMetadata:
    """The SamplingMetadata over staged column sections (``stage_columns``)."""
    return SamplingMetadata(**{n: dev[n] for n in smp.COLUMN_DTYPES})


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of the sorted ``buckets`` that holds ``n`` rows, None if none does."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, then every multiple of 32, and max_batch_size itself."""
    if not isinstance(max_batch_size, int) or max_batch_size <= 0:
        raise ConfigError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    out = [b for b in (1, 2, 4, 8, 16) if b < max_batch_size]
    out += list(range(32, max_batch_size, 32))
    return tuple(sorted({*out, max_batch_size}))


def graph_eligible(batch: ScheduledBatch) -> bool:
    """True when ``batch`` is decode-only with plain sampling (what the graphs compute)."""
    rows = batch.sequences
    slot_rows = batch.rows
    # decode rows over slots (one token each, sampled), also one scheduled ahead whose
    # previous step is not updated yet: their slots' plain flags decide
    if slot_rows is not None and slot_rows.current(len(rows)):
        return bool(rows) and bool(slot_rows.state.plain[slot_rows.slots].all())
    if not rows or set(map(_NEW, rows)) != {1} or not all(map(_SAMPLE, rows)):
        return False
    params = list(map(_PARAMS, rows))
    distinct = dict(zip(map(id, params), params, strict=True)).values()
    return all(p.is_plain for p in distinct)


Forward = Callable[[StepInputs], torch.Tensor | None]
"""Prepared step inputs → logits of the sampled rows (``ModelRunner.forward``)."""

Layout = list[tuple[str, int, int, torch.dtype]]
"""(section, device address, rows, dtype) of each staged section, in staging order."""


def staged_layout(dev: dict[str, torch.Tensor]) -> Layout:
    """The (section, address, rows, dtype) of each uploaded staging section."""
    return [(name, t.data_ptr(), t.shape[0], t.dtype) for name, t in dev.items()]


class DecodeGraphs:
    """The captured decode graphs over one StepInputBuilder, forward and backend (CUDA
    backends only)."""

    def __init__(
        self,
        inputs: StepInputBuilder,
        forward: Forward,
        backend: Backend,
        buckets: tuple[int, ...] | None = None,
        *,
        allow_cpu: bool = False,
        window: WindowState | None = None,
    ) -> None:
        """``allow_cpu``: for tests and host-time tools whose subclass replaces ``capture``.
        ``window``: multi-step decoding's state; its ``advance`` is captured per bucket too
        (``advance``)."""
        if inputs.device.type != "cuda" and not allow_cpu:
            raise ConfigError("CUDA graphs need a CUDA device")
        most = min(inputs.limits.max_batch_size, inputs.limits.max_num_tokens)
        buckets = buckets or default_buckets(most)
        bad = [b for b in buckets if not 0 < b <= most]
        if bad:
            raise ConfigError(
                f"CUDA graph bucket {bad[0]} is outside [1, min(max_batch_size, max_num_tokens)]"
            )
        self.inputs, self.forward, self.backend = inputs, forward, backend
        self.device = inputs.device
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.window = window
        self.advance_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._layout: dict[int, Layout] = {}
        self._dev: dict[int, dict[str, torch.Tensor]] = {}  # each bucket's staged views
        self._pool: Any = None
        n = self.buckets[-1]
        self._ar32 = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        self._ar64 = torch.arange(n, dtype=torch.int64, device=self.device)
        self.capture_seconds = 0.0
        self.replays = 0

    # ---- staging ---------------------------------------------------------------------
    def _stage(
        self,
        big: int,
        rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None,
        seqs: list,
        offset_extra: int = 0,
        cols: dict[str, Any] | None = None,
    ) -> dict:
        """Stage padded inputs of ``big`` rows. ``rows`` = (token ids, positions, slots,
        source rows, block tables [b, nb]) of the ``b`` real rows, or None (capture: the
        bucket's layout is recorded); ``cols``: their sampling columns
        (``StepInputBuilder.decode_step``), else computed from ``seqs``. Each section is
        written in place in the staging buffer."""
        mbs = self.inputs.limits.max_blocks_per_seq
        b = 0 if rows is None else len(rows[0])
        if cols is None:
            cols = smp.sampling_columns(seqs, offset_extra)
        st = self.inputs.staging
        st.begin()
        # (section, index in ``rows``, padding value)
        pads = (
            ("input_ids", 0, 0),
            ("src_rows", 3, -1),
            ("positions", 1, 0),
            ("slot_mapping", 2, -1),
        )
        for name, i, pad in pads:
            view = st.reserve(name, big, "int64")
            if b:
                view[:b] = rows[i]  # type: ignore[index]
            view[b:] = pad
        lens = st.reserve("seq_lens", big, "int32")
        if b:
            lens[:b] = rows[1] + 1  # type: ignore[index]
        lens[b:] = 0
        tables = st.reserve("block_tables", big * mbs, "int32").reshape(big, mbs)
        if b:
            bt = rows[4]  # type: ignore[index]
            tables[:b, : bt.shape[1]] = bt
            tables[:b, bt.shape[1] :] = -1
        tables[b:] = -1
        stage_columns(st, big, b, cols)
        dev = st.upload()
        if rows is None:
            self._layout[big] = staged_layout(dev)
            self._dev[big] = dev
        return dev

    def _body(self, big: int, dev: dict[str, torch.Tensor]) -> None:
        """What one graph computes (also run eagerly as the warm-up)."""
        inputs = self.inputs
        ws, mbs = inputs.workspace, inputs.limits.max_blocks_per_seq
        inputs.gather_input_ids(ws["input_ids"][:big], dev["input_ids"], dev["src_rows"])
        for name in ("positions", "slot_mapping", "seq_lens"):
            ws[name][:big].copy_(dev[name])
        bt = ws["block_tables"].view(-1)[: big * mbs].view(big, mbs)
        bt.copy_(dev["block_tables"].view(big, mbs))
        ws["cu_seqlens_q"][: big + 1].copy_(self._ar32[: big + 1])
        ws["logits_indices"][:big].copy_(self._ar64[:big])
        attn = AttentionMetadata(
            positions=ws["positions"][:big],
            slot_mapping=ws["slot_mapping"][:big],
            cu_seqlens_q=ws["cu_seqlens_q"][: big + 1],
            seq_lens=ws["seq_lens"][:big],
            block_tables=bt,
            num_decode_seqs=big,
            max_query_len=1,
            max_seq_len=inputs.limits.max_seq_len,
            partial_out=ws["attn_partial_out"],
            partial_lse=ws["attn_partial_lse"],
        )
        meta = sampling_metadata(dev)
        inp = StepInputs(
            num_tokens=big,
            num_sampled=big,
            sampled=[],
            attn=attn,
            input_ids=ws["input_ids"][:big],
            logits_indices=ws["logits_indices"][:big],
            sampling=meta,
        )
        logits = self.forward(inp)
        assert logits is not None
        ids = self.backend.sample(logits, meta)
        ws["sampled_ids"][:big].copy_(ids)

    # ---- capture ---------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool."""
        t0 = time.perf_counter()
        be, spec = self.backend, self.inputs.spec
        reserve = getattr(be, "reserve", None)
        if reserve is not None:
            n = max(getattr(be, "max_num_seqs", 0), self.buckets[-1])
            reserve(n, spec.num_heads, spec.head_dim, vocab_rows=self.buckets[-1])
        self._pool = torch.cuda.graph_pool_handle()
        with gc_paused():
            self._capture_buckets()
        self.capture_seconds = time.perf_counter() - t0

    def _capture_buckets(self) -> None:
        for big in sorted(self.buckets, reverse=True):
            dev = self._stage(big, None, [])
            self._body(big, dev)  # eager warm-up: kernel modules, cuBLAS handles
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                self._body(big, dev)
            self.graphs[big] = g
            if self.window is not None:  # multi-step decoding's token feedback, per bucket
                self.window.step.zero_()  # the warm-up writes output row 0 only
                self._advance_eagerly(big)  # warm-up
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    self._advance_eagerly(big)
                self.advance_graphs[big] = g
        torch.cuda.synchronize(self.device)

    # ---- replay ----------------------------------------------------------------------
    @property
    def pool(self) -> Any:
        """The graphs' memory pool (after ``capture``), shared by the prefill graphs."""
        return self._pool

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (
            bool(self.graphs)
            and self.bucket_for(len(batch.sequences)) is not None
            and graph_eligible(batch)
        )

    def stage(
        self,
        batch: ScheduledBatch,
        src_rows: list[int] | None = None,
        span: np.ndarray | None = None,
    ) -> tuple[int, int]:
        """Stage a decode-only ``batch`` (``can_run`` true) for its bucket's graph; returns
        (rows ``b``, bucket). ``src_rows[i] >= 0``: row ``i``'s input token is row
        ``src_rows[i]`` of the previous step's sampled ids, still on the device (async
        scheduling); its sampling offset then counts that token too. ``span``: a
        multi-step window's positions per row (``StepInputBuilder.decode_step``)."""
        rows, cols, _ = self.inputs.decode_step(batch, src_rows, span)
        b = len(rows[0])
        big = self.bucket_for(b)
        assert big is not None
        dev = self._stage(big, rows, [], 1 if src_rows is not None else 0, cols)
        if staged_layout(dev) != self._layout[big]:
            raise EngineError(f"CUDA graph bucket {big}: staging layout changed since capture")
        return b, big

    def advance(self, big: int) -> None:
        """Multi-step decoding, after a replay of bucket ``big``: ``WindowState.advance``
        over the bucket's staged inputs (the next replay reads them), as its captured graph
        when there is one."""
        g = self.advance_graphs.get(big)
        if g is not None:
            g.replay()
        else:
            self._advance_eagerly(big)

    def _advance_eagerly(self, big: int) -> None:
        assert self.window is not None
        dev, mbs = self._dev[big], self.inputs.limits.max_blocks_per_seq
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "offsets")
        self.window.advance(
            big,
            self.inputs.workspace["sampled_ids"][:big],
            {name: dev[name] for name in names},
            dev["block_tables"].view(big, mbs),
        )

    def replay(self, big: int) -> None:
        """Launch bucket ``big``'s graph on what ``stage`` staged; the sampled ids land in
        the first rows of the workspace's ``sampled_ids`` (the caller reads them back)."""
        self.graphs[big].replay()
        self.replays += 1
