"""The tensor-core plan of the weight-only ``linear`` for larger steps (cuda/gemm_wo.cu).

``linear(x [M, K], PackedWeight)`` past the small-step GEMV passes runs either
dequantize-then-cuBLAS (llmc.cuda.gemv_wo_ops: the 16-bit weight written to a temporary in
row chunks, then torch.mm) or gemm_wo.cu, which streams the codes once per M-tile,
dequantizes them into shared memory (the same bit-exact formula, rounded once into the
activation dtype: the same weight values) and multiplies on tensor cores (mma.sync
m16n8k16, float32 accumulation, rounded once).

Which one: ``WoGemmOps.wo_mma`` — False (the default until the bench's ``wo gemm`` rows
are measured on the H200): dequantize-then-cuBLAS everywhere; True: gemm_wo.cu wherever
it applies (``gw_unsupported``); None: the table ``WO_MMA_TABLE`` by rows M.

Invariant: the two plans compute the same rounded weights; they differ only in the order
of the float32 accumulation (tolerance of a float32-accumulated GEMM). ``WoGemmOps`` is a
mixin of ``WoOps`` (which provides ``device``, ``_lib``, ``_launch``, ``_sm_count`` and
the ``_gemv_kernels`` cache).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import ptr as _p
from llmc.cuda.reference_wo import PackedWeight

GW_THREADS = 256  # gemm_wo.cu: 8 warps, 2 (M) x 4 (N)
GW_BK = 64  # columns a k-tile
GW_LDS = GW_BK + 8  # 16-bit elements per shared row (padded: ldmatrix bank spread)
GW_TILES = ((128, 128), (64, 128), (32, 64))  # (BM, BN) the file instantiates, largest first
GW_STATIC_SMEM = 48 * 1024  # above this a kernel needs its dynamic-shared-memory attribute
_NULL = np.uint64(0)

# The plan by rows M when ``wo_mma`` is None: the first entry whose bound holds (None: any
# M). Reasons: up to ~1024 rows the step is bound by weight bytes or near it and gemm_wo.cu
# reads 0.5 (int4) / 1 (int8) byte a weight once per M-tile, where dequantize-then-cuBLAS
# reads the codes, writes and re-reads a 16-bit weight (~4.5 / 5 bytes); past that the GEMM
# is compute-bound, cuBLAS's wgmma kernels outrun mma.sync, and the dequantize is a small
# share of the step. The bound is the brief's starting point, to be replaced by the H200
# rows (``python -m llmc.cuda.bench --only gemvwo``: ``wo gemm`` rows).
WO_MMA_TABLE: tuple[tuple[int | None, str], ...] = ((1024, "mma"), (None, "dequant"))


def gw_kernel_name(bits: int, bm: int, bn: int) -> str:
    return f"gemm_wo{bits}_{bm}x{bn}"


def gw_smem_bytes(bits: int, bm: int, bn: int) -> int:
    """Dynamic shared memory of a gemm_wo.cu launch: two stages of X rows [BM][GW_LDS] and
    code rows [BN][GW_BK * bits / 8], one 16-bit W tile [BN][GW_LDS]."""
    return 2 * bm * GW_LDS * 2 + bn * GW_LDS * 2 + 2 * bn * GW_BK * bits // 8


def gw_tile(m: int, n: int, sms: int) -> tuple[int, int]:
    """(BM, BN) for an M x N output: the largest tile whose grid still fills 90 % of the
    ``sms`` SMs, never more rows than M needs (32-row tiles for M <= 32, 64 for M <= 64)."""
    fits = [t for t in GW_TILES if t[0] < 2 * max(m, 32)]
    for bm, bn in fits:
        if math.ceil(m / bm) * math.ceil(n / bn) >= 0.9 * sms:
            return bm, bn
    return fits[-1]


def gw_grid(m: int, n: int, tile: tuple[int, int]) -> int:
    return math.ceil(m / tile[0]) * math.ceil(n / tile[1])


def gw_unsupported(x: torch.Tensor, w: PackedWeight) -> str | None:
    """Why gemm_wo.cu cannot serve x [M, K] against ``w`` (None: it can)."""
    k = x.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return "float32 activations (16-bit mma operands)"
    if k % 32:
        return f"K = {k} is not a multiple of 32 (whole 16-byte chunks of codes)"
    if w.group_size % 8:
        return f"group size {w.group_size} is not a multiple of 8"
    if x.data_ptr() % 16 or w.codes.data_ptr() % 16:
        return "x or codes base not 16-byte aligned"
    return None


def wo_mma_planned(choice: bool | None, m: int) -> bool:
    """Whether ``wo_mma`` = ``choice`` picks gemm_wo.cu for M rows (support aside)."""
    if choice is not None:
        return choice
    for bound, plan in WO_MMA_TABLE:
        if bound is None or m <= bound:
            return plan == "mma"
    return False


class WoGemmOps:
    """gemm_wo.cu's plan and launch (mixin; see the module docstring)."""

    wo_mma: bool | None = False

    device: torch.device
    _sm_count: int
    _gemv_kernels: dict[tuple[torch.dtype, str], Any]
    _lib: Any
    _launch: Any

    def _wo_mma_serves(self, x: torch.Tensor, w: PackedWeight) -> bool:
        return wo_mma_planned(self.wo_mma, x.shape[0]) and gw_unsupported(x, w) is None

    def _wo_mma(
        self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """out = x @ dequantize(w).T (+ bias), rounded once (gemm_wo.cu); x, w, bias and
        out checked by the caller (linear_wo)."""
        name, grid, smem, args = gw_launch(x, w, bias, out, self._sm_count)
        kern = self._gemv_kernels.get((x.dtype, name))
        if kern is None:
            kern = self._lib(x.dtype).get("gemm_wo", name)
            if smem > GW_STATIC_SMEM:
                kern.max_dynamic_shared_size_bytes = smem
            self._gemv_kernels[(x.dtype, name)] = kern
        cargs = tuple(
            _NULL if a is None else _p(a) if isinstance(a, torch.Tensor) else _i(a) for a in args
        )
        self._launch(kern, (grid,), (GW_THREADS,), cargs, shared_mem=smem)


def gw_launch(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor, sms: int
) -> tuple[str, int, int, tuple[Any, ...]]:
    """(kernel, grid, dynamic shared bytes, arguments: tensors, None for null, ints) of
    the gemm_wo.cu launch for x [M, K] against ``w`` into ``out`` [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    tile = gw_tile(m, n, sms)
    flags = (1 if w.scales.dtype == torch.float32 else 0) | (2 if out.dtype == torch.float32 else 0)
    args = (
        x, w.codes, w.scales, w.offsets, bias, out, m, n, k, w.code_zero, w.group_size,
        w.scales.shape[1], flags,
    )  # fmt: skip
    return gw_kernel_name(w.bits, *tile), gw_grid(m, n, tile), gw_smem_bytes(w.bits, *tile), args
