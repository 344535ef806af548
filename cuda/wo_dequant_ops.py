"""Dequantize-then-cuBLAS and the row gather of the weight-only ops (cuda/wo_dequant.cu).

``_wo_dequant_mm(x, w, bias, out)``: out = x @ dequantize(w).T (+ bias) for the steps the
GEMV kernels and the tiled GEMMs do not take (llmc.cuda.gemv_wo_ops). The 16-bit weight is
dequantized into a temporary of at most ``WO_CHUNK_BYTES`` (``wo_chunk_rows``): a weight that
fits (every 8B projection) in one piece and one GEMM; a larger one (e.g. a quantized
lm_head) in row chunks, under CUDA-graph capture into one of two chunk buffers on a side
stream while torch.mm of the previous chunk runs on the caller's stream, so that the
dequantization (memory-bound) overlaps the GEMMs (compute-bound): 3-10 % off gate_up / down
at M = 512 - 2048 in 24-MB chunks on the H200 (docs/perf/archive-2026-12-03.md, afternoon;
one piece is faster still: WO_CHUNK_BYTES's comment). Launched eagerly, the chunks
stay on the caller's stream: there the host bounds the path, and the events and stream
switches of the overlap cost ~3x the host time a chunk (qkv M = 512, eager: 601 us with it,
173 without, two calls of the same day). The order is kept by events: chunk i's
dequantization waits for chunk i - 2's GEMM (its buffer), chunk i's GEMM for its
dequantization; the side stream first waits for the caller's stream, and the caller's stream
has waited for every side-stream kernel when the call returns, so the buffers (allocated on
the caller's stream) are free for its next work and the capture sees one fork-join a chunk.

The kernel: ``wo_rows_kernel`` (rows of a chunk — ``_wo_dequant_rows``, its arguments
built once per weight — or the rows an embedding looks up, ``_wo_rows``; 8
columns a thread where K % 8 == 0, the group size % 8 == 0 and the buffers are aligned),
bit-exact to ``PackedWeight.dequantize`` rounded once into the activation dtype. (A flat
grid-stride variant with four 8-column units a thread was measured on the H200 on
2026-12-03 and was no faster: 1.35-1.78 against 1.56-1.78 TB/s written, int4 slower.)

``WoDequantOps`` is a mixin: the class using it provides ``device``, ``_lib(dtype)``,
``_launch``, ``_sm_count`` and the side stream ``_wo_side`` (CudaBackend does).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import ptr as _p
from llmc.cuda.reference_wo import PackedWeight

# Dequantized weight rows per cuBLAS call: a bounded temporary (two of them when a weight
# takes several chunks; the memory plan does not count them: they come out of the memory the
# KV pool leaves free, kv_cache_free_gpu_mem_fraction). Large enough that every 8B
# projection is one chunk (gate_up's 16-bit weight is 235 MB; lm_head takes four): a chunk's
# GEMM covers few output columns, so at decode's ~500 rows cuBLAS's grid fills few SMs. On
# the H200 (2026-12-03, scripts/wo_chunk_sweep.py, int4 g128, M = 512): gate_up 343.7 us at
# 24 MB chunks, 304.4 at 48, 308.7 at 128 (two, overlapped), 288.9 at 256 (one); down 169.9
# / 170.3 / 146.1 / 149.4 (the 24-MB figure was the default before; the 12 / 6 / 3 MB
# chunks that would stay in L2 were slower still).
WO_CHUNK_BYTES = 256 << 20
# Chunk rows are a multiple of this: each chunk's torch.mm writes the columns out[:, n0:n1],
# whose base must stay 16-byte aligned (and n1 - n0 a multiple of cuBLAS's tiles) or cuBLAS
# falls back to its unaligned kernels. Before, the chunk was 24 MB // (2 K) rows: 877 for
# down_proj (K = 14336), so every chunk after the first wrote from a 2-byte-aligned base
# (n0 = 877, 1754, ...): 13 % of bf16 cuBLAS on the H200 at M = 8192, against 88 % for
# gate_up, whose K = 4096 gives 3072-row chunks.
WO_CHUNK_ALIGN = 128
WO_ROWS_THREADS = 256  # wo_rows_kernel block
_NULL = np.uint64(0)


def wo_chunk_rows(n: int, k: int, elem: int, chunk_bytes: int | None = None) -> int:
    """Weight rows per dequantize-then-cuBLAS chunk: the rows of ``chunk_bytes`` (default
    ``WO_CHUNK_BYTES``) split evenly over the chunks they need, rounded up to
    ``WO_CHUNK_ALIGN`` (see there)."""
    chunks = max(1, -(-n * k * elem // (chunk_bytes or WO_CHUNK_BYTES)))
    rows = -(-n // chunks)
    return min(n, -(-rows // WO_CHUNK_ALIGN) * WO_CHUNK_ALIGN)


def wo_scale_flags(w: PackedWeight) -> int:
    """The kernels' scale flag: 1 for float32 scales / offsets, 0 for float16."""
    return 1 if w.scales.dtype == torch.float32 else 0


@dataclass(frozen=True)
class _RowsConsts:
    """What the dequantize launches of one weight share (``_wo_dequant_rows``): the
    kernel, the bases and row bytes of codes / scales / offsets, the int arguments."""

    ref: weakref.ref  # the weight (an id may be reused once it is gone)
    kern: Any
    codes: int
    codes_row: int
    scales: int
    scales_row: int
    offsets: int | None
    offsets_row: int
    n: int
    k: int
    ints: tuple  # bits, code_zero, group_size, groups, scale flags (np.int32)
    vec_ok: bool  # K % 8 == 0 and group_size % 8 == 0


def _row_bytes(t: torch.Tensor) -> int:
    return t.stride(0) * t.element_size()


class WoDequantOps:
    """Dequantize-then-cuBLAS and the row gather (mixin; see the module docstring).
    ``wo_dequant_overlap`` False: every chunk on the caller's stream, one buffer;
    ``wo_chunk_bytes``: the chunk's bytes (the bench's comparisons)."""

    wo_dequant_overlap: bool = True
    wo_chunk_bytes: int | None = None  # None: WO_CHUNK_BYTES
    device: torch.device
    _sm_count: int
    _lib: Any
    _launch: Any
    _wo_side: torch.cuda.Stream  # made by CudaBackend's constructor, outside any capture

    def _wo_rows(
        self, w: PackedWeight, ids: torch.Tensor | None, n0: int, t: int, out: torch.Tensor
    ) -> None:
        """out[i] = dequantize(row ids[i]) (ids None: row n0 + i), i < t, in out's dtype."""
        n, k = w.shape
        g = w.scales.shape[1]
        codes = w.codes[n0:] if ids is None else w.codes
        scales = w.scales[n0:] if ids is None else w.scales
        offsets = None if w.offsets is None else (w.offsets[n0:] if ids is None else w.offsets)
        vec = k % 8 == 0 and w.group_size % 8 == 0 and out.data_ptr() % 16 == 0
        vec = vec and codes.data_ptr() % 8 == 0
        per = 8 if vec else 1
        kern = self._lib(out.dtype).get("wo_dequant", "wo_rows_kernel")
        args = (
            _p(ids) if ids is not None else _NULL, _p(codes), _p(scales),
            _p(offsets) if offsets is not None else _NULL, _p(out),
            _i(t), _i(k), np.int64(n if ids is not None else n - n0), _i(w.bits),
            _i(w.code_zero), _i(w.group_size), _i(g), _i(wo_scale_flags(w)), _i(vec),
        )  # fmt: skip
        grid = (math.ceil(k / (per * WO_ROWS_THREADS)), min(t, 65535))
        self._launch(kern, grid, (WO_ROWS_THREADS,), args)

    def _wo_rows_consts(self, w: PackedWeight, dtype: torch.dtype) -> _RowsConsts:
        cache: dict[tuple[int, torch.dtype], _RowsConsts] | None = getattr(self, "_wo_consts", None)
        if cache is None:
            cache = self._wo_consts = {}
        c = cache.get((id(w), dtype))
        if c is None or c.ref() is not w:
            if len(cache) > 4096:  # entries of weights that are gone
                for key in [key for key, v in cache.items() if v.ref() is None]:
                    del cache[key]
            offs = w.offsets
            c = cache[id(w), dtype] = _RowsConsts(
                weakref.ref(w), self._lib(dtype).get("wo_dequant", "wo_rows_kernel"),
                w.codes.data_ptr(), _row_bytes(w.codes), w.scales.data_ptr(),
                _row_bytes(w.scales), None if offs is None else offs.data_ptr(),
                0 if offs is None else _row_bytes(offs), w.shape[0], w.shape[1],
                (_i(w.bits), _i(w.code_zero), _i(w.group_size), _i(w.scales.shape[1]),
                 _i(wo_scale_flags(w))),
                w.shape[1] % 8 == 0 and w.group_size % 8 == 0,
            )  # fmt: skip
        return c

    def _wo_dequant_rows(self, w: PackedWeight, n0: int, t: int, out: torch.Tensor) -> None:
        """``_wo_rows(w, None, n0, t, out)`` with the same launch, its per-weight arguments
        built once (``_RowsConsts``): dequantize-then-cuBLAS launches one a weight (a chunk
        at a time past WO_CHUNK_BYTES), eagerly in prefill and mixed steps, where the host
        bounds it. Python a launch on this project's CPU (launch excluded, 2026-12-03):
        11.3 -> 3.6 us."""
        c = self._wo_rows_consts(w, out.dtype)
        codes = c.codes + n0 * c.codes_row
        vec = c.vec_ok and out.data_ptr() % 16 == 0 and codes % 8 == 0
        offs = _NULL if c.offsets is None else np.uint64(c.offsets + n0 * c.offsets_row)
        args = (
            _NULL, np.uint64(codes), np.uint64(c.scales + n0 * c.scales_row), offs,
            np.uint64(out.data_ptr()), _i(t), _i(c.k), np.int64(c.n - n0), *c.ints, _i(vec),
        )  # fmt: skip
        grid = (math.ceil(c.k / ((8 if vec else 1) * WO_ROWS_THREADS)), min(t, 65535))
        self._launch(c.kern, grid, (WO_ROWS_THREADS,), args)

    def _wo_dequant_mm(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """out = x @ dequantize(w).T (+ bias), chunk by chunk (the module docstring)."""
        n, k = w.shape
        rows = wo_chunk_rows(n, k, x.element_size(), self.wo_chunk_bytes)
        starts = list(range(0, n, rows))
        overlap = self.wo_dequant_overlap and len(starts) > 1 and x.is_cuda
        overlap = overlap and torch.cuda.is_current_stream_capturing()  # see the docstring
        bufs = [torch.empty(rows, k, dtype=x.dtype, device=self.device)]
        if overlap:
            bufs.append(torch.empty(rows, k, dtype=x.dtype, device=self.device))
            main, side = torch.cuda.current_stream(self.device), self._wo_side
            side.wait_stream(main)
            done: list[torch.cuda.Event] = []
        for i, n0 in enumerate(starts):
            n1 = min(n, n0 + rows)
            wd = bufs[i % len(bufs)][: n1 - n0]
            if overlap:
                with torch.cuda.stream(side):
                    if i >= 2:
                        side.wait_event(done[i - 2])
                    self._wo_dequant_rows(w, n0, n1 - n0, wd)
                    ready = torch.cuda.Event()
                    ready.record(side)
                main.wait_event(ready)
            else:
                self._wo_dequant_rows(w, n0, n1 - n0, wd)
            b = None if bias is None else bias[n0:n1]
            dst = out if n1 - n0 == n else out[:, n0:n1]
            if out.dtype != x.dtype:
                dst.copy_(torch.nn.functional.linear(x, wd, b))
            elif b is None:
                torch.mm(x, wd.t(), out=dst)
            else:
                torch.addmm(b, x, wd.t(), out=dst)
            if overlap:
                done.append(torch.cuda.Event())
                done[-1].record(main)
