"""The tensor-core plans of the weight-only ``linear`` for larger steps (cuda/gemm_wo.cu,
cuda/gemm_wo_sm90.cu).

``linear(x [M, K], PackedWeight)`` past the small-step GEMV passes runs one of three plans:

- ``dequant``: dequantize-then-cuBLAS (llmc.cuda.wo_dequant_ops: the 16-bit weight written to
  a temporary in row chunks, then torch.mm);
- ``mma``: gemm_wo.cu (any sm_80+ GPU): the codes staged once per M-tile with cp.async,
  dequantized into shared memory (the same bit-exact formula, rounded once into the
  activation dtype: the same weight values), mma.sync m16n8k16, float32 accumulation,
  rounded once; tiles 128x128 / 64x128 / 32x64 (``gw_tile``);
- ``sm90``: gemm_wo_sm90.cu (sm_90 devices; elsewhere ``mma``): the same dequantization,
  warp specialized (a cp.async producer warpgroup, two consumer warpgroups), wgmma
  m64n128k16 on 128x128 tiles, six stages.

Which one: ``WoGemmOps.wo_gemm`` — one of the plans for every step it applies to
(``gw_unsupported``: else ``dequant``), or ``auto`` (the default): the table
``WO_GEMM_TABLE`` by rows M and output columns N — ``mma`` for wide projections (gate_up)
up to 64 rows, ``dequant`` everywhere else, the fastest plans measured on the H200 and the
H100 (the table's comment); the kernels' GPU tests pass (358 of tests/cuda/test_cuda_wo_gemm.py
on the H200, 2026-12-03; the whole file on the H100, 2026-12-07).

Invariant: every plan computes the same rounded weights; they differ only in the order of
the float32 accumulation (tolerance of a float32-accumulated GEMM). ``WoGemmOps`` is a
mixin of ``WoOps`` (which provides ``device``, ``_lib``, ``_launch``, ``_sm_count`` and
the ``_gemv_kernels`` cache).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import ptr as _p
from llmc.cuda.reference_wo import PackedWeight

GW_THREADS = 256  # gemm_wo.cu: 8 warps, 2 (M) x 4 (N)
GW_BK = 64  # columns a k-tile
GW_LDS = GW_BK + 8  # 16-bit elements per shared row (padded: ldmatrix bank spread)
GW_TILES = ((128, 128), (64, 128), (32, 64))  # (BM, BN) the file instantiates, largest first
GW_STATIC_SMEM = 48 * 1024  # above this a kernel needs its dynamic-shared-memory attribute
_NULL = np.uint64(0)

# The plan under ``wo_gemm = "auto"``: the first entry (most rows M or None = any, fewest
# output columns N, plan) that holds. Measured replayed from CUDA graphs, as the engine runs
# decode (``scripts/wo_plan_sweep.py``, the four 8B projections, int4 g128 and int8):
# - H200, 2026-12-03 (M = 16-2048): dequantize-then-cuBLAS is the fastest plan at every M
#   from 64 on but for gate_up at M = 64 (mma 112 vs 182 us int8, 164 vs 193 int4); mma and
#   sm90 take 0.12-0.29x bf16 cuBLAS's time from M = 128 on against dequantize's 0.33-0.84x
#   (gate_up M = 512 int4: 768 / 769 / 282 us, bf16 157);
# - H100, 2026-12-07 (M = 64, 512, 2048; sm90 warp specialized since): gate_up at M = 64
#   mma 109.0 vs dequant 219.4 us int4, 90.4 vs 214.1 int8; qkv / o_proj / down at M = 64
#   int4 dequant 50.4 / 33.4 / 118.1 vs mma 57.1 / 41.5 / 136.0; at M >= 512 dequant
#   0.54-0.83x bf16 against mma 0.16-0.31x and sm90 0.25-0.37x.
# Dequantize's cost is the whole weight whatever M (a 16-bit copy written and read back), so
# it loses where the weight is wide and M small; both GPUs agree on gate_up (N = 28,672)
# at M = 64, so that entry is mma for N >= 16,384 up to 64 rows (the GEMV passes serve
# M <= 32 int4 / 16 int8 first). The table's first entry of 2026-12-01 (mma up to 64 rows
# for every shape) came from eager timings, where dequantize-then-cuBLAS is bound by its
# launches.
WO_GEMM_TABLE: tuple[tuple[int | None, int, str], ...] = ((64, 16384, "mma"), (None, 0, "dequant"))
WO_GEMM_PLANS = ("dequant", "mma", "sm90", "auto")
GS_STAGES, GS_TILE = 6, 128 * 128  # gemm_wo_sm90.cu: stages, bytes of an X slot / W tile
GS_THREADS = 384  # gemm_wo_sm90.cu: a producer warpgroup and two consumer warpgroups


def gw_kernel_name(bits: int, bm: int, bn: int) -> str:
    return f"gemm_wo{bits}_{bm}x{bn}"


def gw_stages(bm: int) -> int:
    """gemm_wo.cu's cp.async stages (GW_STAGES): 3 for 128-row tiles (two CTAs an SM fit
    the H200's shared memory), 4 for the smaller tiles."""
    return 3 if bm == 128 else 4


def gw_smem_bytes(bits: int, bm: int, bn: int) -> int:
    """Dynamic shared memory of a gemm_wo.cu launch: the stages' X rows [BM][GW_LDS] and
    code rows [BN][GW_BK * bits / 8], one 16-bit W tile [BN][GW_LDS]."""
    s = gw_stages(bm)
    return s * bm * GW_LDS * 2 + bn * GW_LDS * 2 + s * bn * GW_BK * bits // 8


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


def gw_unsupported(x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None) -> str | None:
    """Why the kernels cannot serve x [M, K] against ``w`` into ``out`` (None: they can)."""
    k = x.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return "float32 activations (16-bit mma operands)"
    if k % 32:
        return f"K = {k} is not a multiple of 32 (whole 16-byte chunks of codes)"
    if w.group_size % 8:
        return f"group size {w.group_size} is not a multiple of 8"
    if x.data_ptr() % 16 or w.codes.data_ptr() % 16:
        return "x or codes base not 16-byte aligned"
    if out is not None and out.data_ptr() % 8:  # the epilogue's paired stores
        return "out base not 8-byte aligned"
    return None


def wo_gemm_planned(choice: str, m: int, sm90: bool, n: int = 0) -> str:
    """The plan ``wo_gemm`` = ``choice`` picks for M rows of N output columns (support
    aside); ``sm90`` is ``mma`` off sm_90 devices."""
    if choice not in WO_GEMM_PLANS:
        raise UnsupportedError(
            f"CudaBackend.wo_gemm = {choice!r}: choose one of {', '.join(WO_GEMM_PLANS)}"
        )
    plan = choice
    if choice == "auto":
        plan = next(
            p for most, min_n, p in WO_GEMM_TABLE if (most is None or m <= most) and n >= min_n
        )
    return "mma" if plan == "sm90" and not sm90 else plan


def wo_gemm_plan(
    choice: str, x: torch.Tensor, w: PackedWeight, sm90: bool, out: torch.Tensor | None = None
) -> str:
    """The plan that runs x [M, K] against ``w`` under ``wo_gemm`` = ``choice``:
    ``wo_gemm_planned``, then ``dequant`` where the kernels do not apply."""
    plan = wo_gemm_planned(choice, x.shape[0], sm90, w.shape[0])
    if plan == "dequant" or gw_unsupported(x, w, out):
        return "dequant"
    return plan


def gs_smem_bytes(bits: int) -> int:
    """Dynamic shared memory of a gemm_wo_sm90.cu launch: X slots, two W tiles, code slots,
    a full and an empty mbarrier a stage, and 1024 bytes to round the base up to the
    swizzle's alignment."""
    return (GS_STAGES + 2) * GS_TILE + GS_STAGES * (128 * GW_BK * bits // 8 + 16) + 1024


def gw_threads(plan: str) -> int:
    """Threads a CTA of the ``plan`` (mma or sm90) launch."""
    return GS_THREADS if plan == "sm90" else GW_THREADS


def gw_row_scaled(w: PackedWeight) -> bool:
    """Whether gemm_wo.cu scales ``w`` in its epilogue (flags & 4: one group a row and no
    offsets, e.g. int8_wo): the W tile holds the exact integers code - code_zero, the sum is
    multiplied by the row's scale once; otherwise (and always in gemm_wo_sm90.cu) each
    weight is dequantized and rounded."""
    return w.scales.shape[1] == 1 and w.offsets is None


def gw_launch(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor, sms: int,
    plan: str = "mma",
) -> tuple[str, str, int, int, tuple[Any, ...]]:  # fmt: skip
    """(family, kernel, grid, dynamic shared bytes, arguments: tensors, None for null, ints)
    of the ``plan`` (mma or sm90) launch for x [M, K] against ``w`` into ``out`` [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    flags = (1 if w.scales.dtype == torch.float32 else 0) | (2 if out.dtype == torch.float32 else 0)
    flags |= 4 if plan != "sm90" and gw_row_scaled(w) else 0  # gemm_wo.cu only
    args = (
        x, w.codes, w.scales, w.offsets, bias, out, m, n, k, w.code_zero, w.group_size,
        w.scales.shape[1], flags,
    )  # fmt: skip
    if plan == "sm90":
        grid = gw_grid(m, n, (128, 128))
        return "gemm_wo_sm90", f"gemm_wo{w.bits}_sm90", grid, gs_smem_bytes(w.bits), args
    tile = gw_tile(m, n, sms)
    name = gw_kernel_name(w.bits, *tile)
    return "gemm_wo", name, gw_grid(m, n, tile), gw_smem_bytes(w.bits, *tile), args


class WoGemmOps:
    """The tensor-core plans and their launch (mixin; see the module docstring)."""

    wo_gemm: str = "auto"

    device: torch.device
    _sm_count: int
    _gemv_kernels: dict[tuple[torch.dtype, str], Any]
    _lib: Any
    _launch: Any

    def _wo_gemm_plan(
        self, x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None
    ) -> str:
        """``dequant``, ``mma`` or ``sm90`` for x [M, K] against ``w`` into ``out``."""
        if self.wo_gemm == "dequant":
            return "dequant"
        return wo_gemm_plan(self.wo_gemm, x, w, self._wo_sm90, out)

    @functools.cached_property
    def _wo_sm90(self) -> bool:
        """Whether the device is sm_90 (asked once: ``_wo_gemm_plan`` runs per linear)."""
        if self.device.type != "cuda":
            return False
        return torch.cuda.get_device_capability(self.device) == (9, 0)

    def _wo_gemm(
        self, plan: str, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        """out = x @ dequantize(w).T (+ bias), rounded once, by ``plan`` (mma or sm90); x,
        w, bias and out checked by the caller (linear_wo)."""
        family, name, grid, smem, args = gw_launch(x, w, bias, out, self._sm_count, plan)
        kern = self._gemv_kernels.get((x.dtype, name))
        if kern is None:
            kern = self._lib(x.dtype).get(family, name)
            if smem > GW_STATIC_SMEM:
                kern.max_dynamic_shared_size_bytes = smem
            self._gemv_kernels[(x.dtype, name)] = kern
        cargs = tuple(
            _NULL if a is None else _p(a) if isinstance(a, torch.Tensor) else _i(a) for a in args
        )
        self._launch(kern, (grid,), (gw_threads(plan),), cargs, shared_mem=smem)
