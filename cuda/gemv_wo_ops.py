"""Weight-only ops of the CudaBackend on ``PackedWeight``s (cuda/gemv_wo.cu, cuda/wo_dequant.cu,
cuda/gemm_wo.cu).

The CudaBackend dispatches on the weight's type: ``norm_linear``, ``norm_gate_up_silu`` and
``linear_residual_add`` (this mixin, ahead of ``GemvOps`` in the MRO: a tensor weight goes
on to the BF16 kernels), ``linear`` and ``embedding`` (CudaBackend's own, which call
``linear_wo`` / ``embedding_wo`` here). The plans:

- small steps (T <= ``GEMV_MAX_TOKENS`` rows, 16-bit activations): one gemv_wo.cu kernel
  per op, dequantizing in registers, with the norm prologue and the SiLU / residual / bias
  epilogues; the scale mode from the group size (``wo_scale_mode``), the activations staged
  in shared memory (``wo_smem_bytes``); the codes streamed through a shared-memory ring of
  ``wo_ring_stages`` stages after them (the ``_ring`` kernels: vector path, 4-byte aligned
  scales / offsets, at least 2 stages fit), else by the register-stream kernels;
- larger steps where ``WoGemmOps.wo_gemm`` picks it: gemm_wo.cu (mma.sync) or
  gemm_wo_sm90.cu (wgmma), codes dequantized into shared memory ahead of tensor-core MMAs
  (llmc.cuda.gemm_wo_ops: the plans and their table);
- anything else (T > 8, float32 activations, a staging that exceeds the shared-memory
  budget, a group size that is not a multiple of 16): dequantize-then-cuBLAS
  (llmc.cuda.wo_dequant_ops: wo_dequant.cu, bit-exact, rounded once into the activation
  dtype, in row chunks on a side stream, each chunk one torch.mm into its columns of
  ``out``); the fused ops then run their unfused sequences (rms_norm, linear,
  silu_and_mul / add), which compute the same values.
- ``embedding``: wo_dequant.cu's row gather, rows dequantized into ``out``'s dtype.

``WoOps`` is a mixin: the class using it provides ``device``, ``_lib(dtype)``, ``_launch``,
``_sm_count``, ``_gemv_smem``, the ``_gemv_kernels`` cache, ``rms_norm`` and
``silu_and_mul`` (CudaBackend does).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.gemm_wo_ops import WoGemmOps
from llmc.cuda.gemv_ops import GEMV_MAX_TOKENS, GEMV_THREADS, check_token_rows
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p
from llmc.cuda.reference_wo import PackedWeight
from llmc.cuda.wo_dequant_ops import WoDequantOps, wo_scale_flags

WO_ACT_DTYPES = (torch.float16, torch.bfloat16)  # gemv_wo.cu: 16-bit mma operands
WO_SMEM_MARGIN = 1024  # gemv_wo.cu's static shared memory (8.7 KB) is ~0.5 KB above gemv.cu's
WO_WARPS = 16  # gemv_wo.cu: 512 threads
WO_STAGES_SHIFT = 8  # wo_ring.cuh: flags >> 8 = the ring's stages
WO_MAX_STAGES = 16
_MODES = ("norm", "norm_silu", "add", "linear")
_NULL = np.uint64(0)


def wo_kstep_cols(bits: int) -> int:
    """Columns of one k-step of gemv_wo.cu: 4 lanes x one 16-byte code vector."""
    return 128 if bits == 4 else 64


def wo_scale_mode(bits: int, k: int, group_size: int) -> str | None:
    """gemv_wo.cu's scale mode: ``row`` (one group per row), ``kstep`` (whole k-steps per
    group), ``deq`` (groups of a multiple of 16 columns), None (no kernel: dequantize)."""
    if group_size == k:
        return "row"
    if group_size % wo_kstep_cols(bits) == 0:
        return "kstep"
    return "deq" if group_size % 16 == 0 else None


def wo_row_stride(bits: int, k: int) -> int:
    """Shared-memory bytes per staged activation row: K in whole k-steps of 16-bit values,
    plus 64 (the two token rows of one LDS.128 phase in different banks)."""
    ks = wo_kstep_cols(bits)
    return -(-k // ks) * ks * 2 + 64


def wo_has_sums(bits: int, scale_mode: str | None, offsets: bool) -> bool:
    """Whether a gemv_wo.cu launch stages per-k-step (row mode: per-row) activation sums:
    for the offsets of the row / kstep modes, and in every launch with biased codes (4-bit
    kstep, 8-bit row / kstep: magic + q), which takes (magic + code_zero) x the sum off the
    mma sums (wo_codes.cuh's wo_has_sums, the same rule)."""
    if scale_mode not in ("row", "kstep"):
        return False
    return offsets or scale_mode == "kstep" or bits == 8


def wo_prefetches(bits: int, scale_mode: str | None, prefetch: bool) -> bool:
    """Whether a gemv_wo.cu launch asks the L2 for the code vectors ahead (``WO_PREFETCH``):
    where ``WoOps.wo_prefetch`` says so, but not for the biased 8-bit codes (row / kstep),
    whose GEMVs it slowed on the H200 (2026-12-03, one 8B layer at T = 1: gate_up 49.6 µs
    with, 38.9 without; down 27.5 / 22.9; qkv, o_proj equal; docs/PERFORMANCE.md)."""
    return prefetch and not (bits == 8 and scale_mode in ("row", "kstep"))


def wo_smem_bytes(bits: int, k: int, group_size: int, m: int, offsets: bool) -> int:
    """Dynamic shared memory of a gemv_wo.cu launch: M staged rows, plus the per-k-step (or
    per-row) activation sums where ``wo_has_sums``."""
    mode = wo_scale_mode(bits, k, group_size)
    sums = 0
    if wo_has_sums(bits, mode, offsets):
        sums = m * (1 if mode == "row" else -(-k // wo_kstep_cols(bits))) * 4
    return m * wo_row_stride(bits, k) + sums


def wo_ring_stage_bytes(scale_mode: str, bits: int, group_size: int) -> int:
    """Shared memory of one ring stage (wo_ring.cuh): 16 warps x CH chunks x 512 bytes, CH =
    2 code chunks + the scale words (row: none; kstep, deq: 1 chunk, 2 where one code
    vector spans two groups: 4-bit, group_size % 32 != 0)."""
    two = scale_mode == "deq" and group_size % (32 if bits == 4 else 16) != 0
    return WO_WARPS * 512 * (2 if scale_mode == "row" else 4 if two else 3)


def wo_ring_offset(bits: int, k: int, group_size: int, m: int, offsets: bool) -> int:
    """Byte offset of the ring in the dynamic shared memory: after the staging and the sums,
    16-byte aligned (gemv_wo.cu's ``ring_off``)."""
    return -(-wo_smem_bytes(bits, k, group_size, m, offsets) // 16) * 16


def wo_ring_stages(
    bits: int, k: int, group_size: int, m: int, offsets: bool, budget: int, most: int
) -> int:
    """Stages of the *_ring kernels: as many as the shared-memory budget holds, at most
    ``most`` (<= 16); 0 (the register kernels) where fewer than 2 fit."""
    mode = wo_scale_mode(bits, k, group_size)
    if mode is None:
        return 0
    room = budget - wo_ring_offset(bits, k, group_size, m, offsets)
    r = min(most, WO_MAX_STAGES, room // wo_ring_stage_bytes(mode, bits, group_size))
    return r if r >= 2 else 0


def wo_tiles(mode: int, n_out: int) -> int:
    """Tiles of a gemv_wo.cu launch: 16 rows, or 8 gate + 8 up rows (mode 1)."""
    return math.ceil(n_out / (8 if mode == 1 else 16))


def wo_kernel_name(bits: int, scale_mode: str, mode: int, vector: bool, ring: bool = False) -> str:
    """gemv_wo.cu's kernel: vector (register stream), ``_ring`` (vector, shared-memory
    ring) or ``_scalar``."""
    if not vector:
        return f"gemv_wo{bits}_{scale_mode}_{_MODES[mode]}_scalar"
    return f"gemv_wo{bits}_{scale_mode}_{_MODES[mode]}" + ("_ring" if ring else "")


def check_packed(op: str, w: Any, k: int | None = None) -> tuple[int, int]:
    """(N, K) of a PackedWeight whose tensors are contiguous CUDA tensors (K = ``k`` when
    given: the input's columns)."""
    if not isinstance(w, PackedWeight):
        raise UnsupportedError(f"CudaBackend.{op}: weight must be a PackedWeight")
    _need(w.codes, "weight codes", torch.uint8)
    _need(w.scales, "weight scales")
    if w.offsets is not None:
        _need(w.offsets, "weight offsets", w.scales.dtype)
    n, wk = w.shape
    if k is not None and wk != k:
        raise UnsupportedError(
            f"CudaBackend.{op}: input of {k} columns and weight {[n, wk]} do not chain "
            f"([M, K] x [N, K])"
        )
    return n, wk


class WoOps(WoGemmOps, WoDequantOps):
    """The weight-only ops (mixin; see the module docstring for what it needs).

    ``wo_gemv_passes`` (most passes for 4-bit, 8-bit codes): ``linear`` with T > 8 rows runs
    the gemv kernel once per 8 rows (fewer where the staging budget holds fewer: ``_wo_passes``)
    while that reads fewer bytes than dequantize-then-cuBLAS (which
    reads the codes, writes and reads a 16-bit weight: ~4.5 bytes per int4 weight): up to
    4 passes (T <= 32) for 4-bit codes, 2 (T <= 16) for 8-bit. Not yet measured: the bench's
    ``wo linear`` rows at M = 16 / 32 / 64 say where it should be.
    """

    wo_gemv_passes: tuple[int, int] = (4, 2)
    # Most stages of the *_ring kernels (wo_ring.cuh; each one k-step, 32 code bytes a lane;
    # the budget may allow fewer); 0 = the register-stream kernels. Measured on the H200
    # (272b320, the bench's "stages" rows, docs/PERFORMANCE.md): the ring is slower for
    # int4 g128 at every depth (one 8B layer 26 % of copy against 30 %) and ~5 points faster
    # for int8 at 2-4 stages; its GPU test batch was cut before pytest named its failures,
    # so the verified register kernels stay the default.
    wo_stages: int = 0
    # gemv_wo.cu's L2 prefetch two batches ahead (flags & 4; not yet measured: the bench's
    # "no L2 prefetch" rows)
    wo_prefetch: bool = True
    # programmatic dependent launch of the fused GEMVs (with CudaBackend.pdl) up to this many
    # token rows: the int4 g128 layer chain measured 78.7 -> 75.3 us at M = 1 and 86.5 ->
    # 91.1 at M = 4 (H100, scripts/pdl_chain.py, 2026-12-07); M = 2, 3 unmeasured
    pdl_wo_max_tokens: int = 1

    device: torch.device
    _sm_count: int
    _gemv_smem: int
    _gemv_kernels: dict[tuple[torch.dtype, str], Any]
    _lib: Any
    _launch: Any
    rms_norm: Any
    silu_and_mul: Any

    # ---- plans ---------------------------------------------------------------------------
    def _wo_budget(self) -> int:
        return self._gemv_smem - WO_SMEM_MARGIN

    def _wo_fit_rows(self, x: torch.Tensor, w: PackedWeight) -> int:
        """Most token rows (<= 8) one gemv_wo.cu launch stages within the shared-memory budget
        for x [*, K] against ``w``; 0 where the kernels do not serve it (dtype, scale mode)."""
        k = x.shape[1]
        if x.dtype not in WO_ACT_DTYPES or wo_scale_mode(w.bits, k, w.group_size) is None:
            return 0
        per_row = wo_smem_bytes(w.bits, k, w.group_size, 1, w.offsets is not None)
        return min(GEMV_MAX_TOKENS, self._wo_budget() // per_row)  # the staging is M x per_row

    def _wo_passes(self, x: torch.Tensor, w: PackedWeight, most: int) -> list[tuple[int, int]]:
        """Row ranges of x [M, K] (M > 0) for at most ``most`` gemv_wo.cu launches of as many
        rows as the staging budget allows; [] where that takes more (then: dequantize-then-cuBLAS).
        More than 8 rows, or 8 rows of a long K (down_proj's 14,336 columns: 229 KB of staging
        at 8 rows against a 195 KB budget), need more than one launch: each reads the weight
        again, still fewer bytes than dequantizing it (docs/PERFORMANCE.md, 2026-12-03)."""
        m, fit = x.shape[0], self._wo_fit_rows(x, w)
        if fit == 0 or -(-m // fit) > most:
            return []
        return [(r0, min(m, r0 + fit)) for r0 in range(0, m, fit)]

    def _wo_gemv(
        self, mode: int, x: torch.Tensor, norm_w: torch.Tensor | None, eps: float,
        w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor, n_out: int,
    ) -> None:  # fmt: skip
        """Launch the gemv_wo.cu kernel of ``mode`` (0 norm, 1 norm_silu, 2 add, 3 linear)."""
        m, k = x.shape
        smode = wo_scale_mode(w.bits, k, w.group_size)
        row_bytes = w.codes.shape[1]
        bases = (x, w.codes) + ((norm_w,) if norm_w is not None else ())
        vector = row_bytes % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in bases)
        offs = w.offsets is not None
        smem = wo_smem_bytes(w.bits, k, w.group_size, m, offs)
        stages = 0
        scale_t = (w.scales,) + ((w.offsets,) if offs else ())
        if vector and all(t.data_ptr() % 4 == 0 for t in scale_t):  # wo_ring.cuh's words
            stages = wo_ring_stages(
                w.bits, k, w.group_size, m, offs, self._wo_budget(), self.wo_stages
            )
        if stages:
            smem = wo_ring_offset(w.bits, k, w.group_size, m, offs)
            smem += stages * wo_ring_stage_bytes(smode, w.bits, w.group_size)
        name = wo_kernel_name(w.bits, smode, mode, vector, stages > 0)
        kern = self._gemv_kernels.get((x.dtype, name))
        if kern is None:
            kern = self._lib(x.dtype).get("gemv_wo", name)
            kern.max_dynamic_shared_size_bytes = self._wo_budget()
            self._gemv_kernels[(x.dtype, name)] = kern
        flags = wo_scale_flags(w) | (2 if out.dtype == torch.float32 else 0)
        flags |= 4 if wo_prefetches(w.bits, smode, self.wo_prefetch) else 0
        flags |= stages << WO_STAGES_SHIFT
        args = (
            _p(x), _p(norm_w) if norm_w is not None else _NULL, np.float32(eps), _p(w.codes),
            _p(w.scales), _p(w.offsets) if w.offsets is not None else _NULL,
            _p(bias) if bias is not None else _NULL, _p(out), _i(n_out), _i(k), _i(m),
            _i(wo_row_stride(w.bits, k)), _i(w.group_size), _i(w.scales.shape[1]),
            _i(w.code_zero), _i(flags),
        )  # fmt: skip
        grid = max(1, min(self._sm_count, wo_tiles(mode, n_out)))
        pdl = m <= self.pdl_wo_max_tokens
        self._launch(kern, (grid,), (GEMV_THREADS,), args, shared_mem=smem, pdl=pdl)

    # ---- ops -----------------------------------------------------------------------------
    def linear_wo(
        self,
        x: torch.Tensor,
        weight: PackedWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, K] @ dequantize(weight).T (+ bias) [T, N], rounded to x's dtype (``out``
        may be float32: the rounded values, as the BF16 linear gives float32 logits)."""
        _need(x, "x")
        n, _ = check_packed("linear", weight, x.shape[1] if x.dim() == 2 else None)
        t = x.shape[0]
        if bias is not None:
            _need(bias, "bias", x.dtype)
        if out is None:
            out = torch.empty(t, n, dtype=x.dtype, device=self.device)
        if tuple(out.shape) != (t, n) or out.dtype not in (x.dtype, torch.float32):
            raise UnsupportedError(
                f"CudaBackend.linear: out {out.dtype} {list(out.shape)}, expected "
                f"{x.dtype} or float32 {[t, n]}"
            )
        _need(out, "out")
        if t == 0:
            return out
        passes = self._wo_passes(x, weight, self.wo_gemv_passes[weight.bits == 8])
        if passes:
            for r0, r1 in passes:  # the weight read once per pass of <= 8 rows
                self._wo_gemv(3, x[r0:r1], None, 0.0, weight, bias, out[r0:r1], n)
            return out
        plan = self._wo_gemm_plan(x, weight, out)  # llmc.cuda.gemm_wo_ops
        if plan != "dequant":
            self._wo_gemm(plan, x, weight, bias, out)
            return out
        self._wo_dequant_mm(x, weight, bias, out)  # llmc.cuda.wo_dequant_ops
        return out

    def embedding_wo(
        self, ids: torch.Tensor, table: PackedWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids [T] int64 -> the dequantized rows [T, H] in out's dtype (float32 when None);
        ids outside [0, V) give zero rows."""
        _need(ids, "ids", torch.int64)
        _, h = check_packed("embedding", table)
        t = ids.shape[0]
        if out is None:
            out = torch.empty(t, h, dtype=torch.float32, device=self.device)
        _need(out, "out")
        if tuple(out.shape) != (t, h):
            raise UnsupportedError(
                f"CudaBackend.embedding: out {list(out.shape)}, expected {[t, h]}"
            )
        if t:
            self._wo_rows(table, ids, 0, t, out)
        return out

    def norm_linear(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """linear(rms_norm(residual), weight, bias); a PackedWeight in one gemv_wo kernel."""
        if not isinstance(weight, PackedWeight):
            return super().norm_linear(residual, norm_weight, eps, weight, bias, out)  # type: ignore[misc]
        op = "norm_linear"
        m, n = self._wo_check(op, residual, weight, norm_weight)
        if out is None:
            out = torch.empty(m, n, dtype=residual.dtype, device=self.device)
        self._wo_out(op, "out", out, (m, n), residual.dtype)
        if bias is not None:
            _need(bias, "bias", residual.dtype)
        if m == 0:
            return out
        passes = self._wo_fused_passes(residual, weight)
        if not passes:
            return self.linear_wo(self.rms_norm(residual, norm_weight, eps), weight, bias, out)
        for r0, r1 in passes:
            self._wo_gemv(0, residual[r0:r1], norm_weight, eps, weight, bias, out[r0:r1], n)
        return out

    def norm_gate_up_silu(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor | PackedWeight,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu_and_mul(linear(rms_norm(residual), gate_up)); a PackedWeight in one kernel."""
        w = gate_up_weight
        if not isinstance(w, PackedWeight):
            return super().norm_gate_up_silu(residual, norm_weight, eps, w, out)  # type: ignore[misc]
        op = "norm_gate_up_silu"
        m, n2 = self._wo_check(op, residual, w, norm_weight)
        if n2 % 2:
            raise UnsupportedError(
                f"CudaBackend.{op}: gate_up weight has {n2} rows; expected gate | up (even)"
            )
        if out is None:
            out = torch.empty(m, n2 // 2, dtype=residual.dtype, device=self.device)
        self._wo_out(op, "out", out, (m, n2 // 2), residual.dtype)
        if m == 0:
            return out
        passes = self._wo_fused_passes(residual, w)
        if not passes:
            gate_up = self.linear_wo(self.rms_norm(residual, norm_weight, eps), w)
            return self.silu_and_mul(gate_up, out=out)
        for r0, r1 in passes:
            self._wo_gemv(1, residual[r0:r1], norm_weight, eps, w, None, out[r0:r1], n2 // 2)
        return out

    def linear_residual_add(
        self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, residual: torch.Tensor
    ) -> torch.Tensor:
        """residual += linear(x, weight) in place; a PackedWeight in one kernel."""
        if not isinstance(weight, PackedWeight):
            return super().linear_residual_add(x, weight, residual)  # type: ignore[misc]
        op = "linear_residual_add"
        m, n = self._wo_check(op, x, weight, None)
        self._wo_out(op, "residual", residual, (m, n), x.dtype)
        if m == 0:
            return residual
        passes = self._wo_fused_passes(x, weight)
        if not passes:
            return residual.add_(self.linear_wo(x, weight))
        for r0, r1 in passes:
            self._wo_gemv(2, x[r0:r1], None, 0.0, weight, None, residual[r0:r1], n)
        return residual

    def _wo_fused_passes(self, x: torch.Tensor, w: PackedWeight) -> list[tuple[int, int]]:
        """The fused ops' launches for x [M, K], M <= 8 rows: as many as ``linear`` would take
        (``wo_gemv_passes``), else none (the unfused sequence)."""
        if not 0 < x.shape[0] <= GEMV_MAX_TOKENS:
            return []
        return self._wo_passes(x, w, self.wo_gemv_passes[w.bits == 8])

    def _wo_check(
        self, op: str, x: torch.Tensor, w: PackedWeight, norm_w: torch.Tensor | None
    ) -> tuple[int, int]:
        _need(x, "x")
        if x.dim() != 2:
            raise UnsupportedError(f"CudaBackend.{op}: input must be [M, K], got {list(x.shape)}")
        n, _ = check_packed(op, w, x.shape[1])
        check_token_rows(op, x.shape[0])
        if norm_w is not None:
            self._wo_out(op, "norm weight", norm_w, (x.shape[1],), x.dtype)
        return x.shape[0], n

    def _wo_out(
        self, op: str, name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype
    ) -> None:
        _need(t, name, dtype)
        if tuple(t.shape) != shape:
            raise UnsupportedError(
                f"CudaBackend.{op}: {name} has shape {list(t.shape)}, expected {list(shape)}"
            )
