"""Fused small-step FP8 ops of the CudaBackend (cuda/gemv_fp8.cu): launch plans and the ops.

``norm_linear_fp8`` (RMSNorm → e4m3 → qkv), ``norm_gate_up_silu_fp8`` (RMSNorm → e4m3 →
gate/up → SiLU·mul) and ``linear_residual_add_fp8`` (x → e4m3 → o_proj / down + residual
add in place) on e4m3 weights with one float32 scale per output row, for steps of at most
``GEMV_MAX_TOKENS`` token rows: one kernel each, the activation quantized per row in the
kernel's prologue (``llmc.cuda.reference_fp8`` gives the recipe and the values).

Plan: one CTA of ``GEMV_THREADS`` per SM, never more CTAs than tiles (16 weight rows; 8
outputs of gate | up); the e4m3 codes of the M rows staged in shared memory at a row stride
of ``gemv8_stride(K)`` bytes. When M times that exceeds the staging budget (K above ~24k at
M = 8) the op runs the unfused sequence instead (quantizing norm, W8A8 GEMM), which
computes the same values.

``GemvFp8Ops`` is a mixin: the class using it provides ``device``, ``_lib(dtype)``,
``_launch``, ``_sm_count``, ``_gemv_smem``, the ``_gemv_kernels`` cache, and the unfused
FP8 ops ``rms_norm_fp8``, ``quantize_fp8``, ``linear_fp8``, ``silu_and_mul`` (CudaBackend does).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.gemv_ops import GEMV_THREADS, check_token_rows
from llmc.cuda.launch_args import aligned as _aligned
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p

FP8 = torch.float8_e4m3fn
GEMV8_STATIC_SMEM = 2048  # dynamic budget = the gemv budget less this: the fp8 kernels'
# static shared memory (8.8 KB: split-K partials, reductions) is ~0.8 KB above gemv.cu's
GEMV8_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gemv8_tiles(mode: int, n_out: int) -> int:
    """Weight tiles of a launch: 16 rows, or 8 gate + 8 up rows (mode 1) per tile."""
    return math.ceil(n_out / (8 if mode == 1 else 16))


def gemv8_grid(mode: int, n_out: int, sm_count: int) -> int:
    """CTAs of a gemv_fp8.cu launch: one per SM, never more than the tiles."""
    return max(1, min(sm_count, gemv8_tiles(mode, n_out)))


def gemv8_stride(k: int) -> int:
    """Shared-memory row stride of the staged codes: K rounded up to 128 bytes, plus 64, so
    the token rows one LDS phase reads start 16 banks apart (conflict-free)."""
    return -(-k // 128) * 128 + 64


class GemvFp8Ops:
    """The fused small-step FP8 ops (mixin; see the module docstring for what it needs)."""

    device: torch.device
    _sm_count: int
    _gemv_smem: int
    _gemv_kernels: dict[tuple[torch.dtype, str], Any]
    _lib: Any
    _launch: Any
    _check: Any  # GemvOps._check: contiguous CUDA tensor of one shape and dtype
    _linear_out: Any  # GemvOps._linear_out: the checked [M, N] output (and bias)
    _gate_up_out: Any  # GemvOps._gate_up_out: the [M, I] output of a gate | up weight
    rms_norm_fp8: Any
    quantize_fp8: Any
    linear_fp8: Any
    silu_and_mul: Any

    def _gemv8_budget(self) -> int:
        return self._gemv_smem - GEMV8_STATIC_SMEM

    def _gemv8_fused(self, m: int, k: int) -> bool:
        """Whether the kernel stages M rows of K codes (else: the unfused sequence)."""
        return m * gemv8_stride(k) <= self._gemv8_budget()

    def _gemv8(
        self,
        family: str,
        mode: int,
        x: torch.Tensor,
        n_out: int,
        aligned: tuple[torch.Tensor, ...],
        args: tuple,
    ) -> None:
        """Launch ``family``_m<M> for x [M, K], ``n_out`` outputs; ``args`` go before
        (N, K, S)."""
        m, k = x.shape
        vec_ok = k % 16 == 0 and _aligned(*aligned)
        name = f"{family}_m{m}" + ("" if vec_ok else "_scalar")
        kern = self._gemv_kernels.get((x.dtype, name))
        if kern is None:
            kern = self._lib(x.dtype).get("gemv_fp8", name)
            kern.max_dynamic_shared_size_bytes = self._gemv8_budget()
            self._gemv_kernels[(x.dtype, name)] = kern
        s = gemv8_stride(k)
        grid = gemv8_grid(mode, n_out, self._sm_count)
        self._launch(
            kern, (grid,), (GEMV_THREADS,), args + (_i(n_out), _i(k), _i(s)), m * s, pdl=True
        )

    def _check_gemv8(
        self,
        op: str,
        x: torch.Tensor,
        x_name: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        norm_weight: torch.Tensor | None = None,
    ) -> tuple[int, int]:
        """(M, rows) of x [M, K] against an e4m3 weight [rows, K] and its float32 scales."""
        _need(x, x_name)
        if x.dtype not in GEMV8_ACT_DTYPES:
            raise UnsupportedError(f"CudaBackend.{op}: {x_name} dtype {x.dtype} is not supported")
        _need(weight, "weight", FP8)
        _need(weight_scale, "weight scale", torch.float32)
        if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
            raise UnsupportedError(
                f"CudaBackend.{op}: {x_name} {list(x.shape)} and weight {list(weight.shape)} "
                f"do not chain ([M, K] x [N, K])"
            )
        m, rows = x.shape[0], weight.shape[0]
        check_token_rows(op, m)
        self._check(op, "weight scale", weight_scale, (rows,), torch.float32)
        if norm_weight is not None:
            self._check(op, "norm weight", norm_weight, (x.shape[1],), x.dtype)
        return m, rows

    def norm_linear_fp8(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """linear_fp8(rms_norm_fp8(residual), weight, weight_scale, bias) in one kernel."""
        op, dt = "norm_linear_fp8", residual.dtype
        m, n = self._check_gemv8(op, residual, "residual", weight, weight_scale, norm_weight)
        out = self._linear_out(op, m, n, bias, out, dt)
        if m == 0:
            return out
        if not self._gemv8_fused(m, residual.shape[1]):
            x = self.rms_norm_fp8(residual, norm_weight, eps)
            return self.linear_fp8(x, weight, weight_scale, bias, dt, out=out)
        args = (
            _p(residual), _p(norm_weight), np.float32(eps), _p(weight), _p(weight_scale),
            _p(bias) if bias is not None else np.uint64(0), _p(out),
        )  # fmt: skip
        self._gemv8("gemv8_norm", 0, residual, n, (residual, norm_weight, weight), args)
        return out

    def norm_gate_up_silu_fp8(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        gate_up_scale: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu_and_mul(linear_fp8(rms_norm_fp8(residual), gate_up)) in one kernel."""
        op, dt, w = "norm_gate_up_silu_fp8", residual.dtype, gate_up_weight
        m, n2 = self._check_gemv8(op, residual, "residual", w, gate_up_scale, norm_weight)
        out = self._gate_up_out(op, m, n2, out, dt)
        if m == 0:
            return out
        if not self._gemv8_fused(m, residual.shape[1]):
            x = self.rms_norm_fp8(residual, norm_weight, eps)
            gate_up = self.linear_fp8(x, w, gate_up_scale, None, dt)
            return self.silu_and_mul(gate_up, out=out)
        args = (
            _p(residual), _p(norm_weight), np.float32(eps), _p(w), _p(gate_up_scale), _p(out),
        )  # fmt: skip
        self._gemv8("gemv8_norm_silu", 1, residual, n2 // 2, (residual, norm_weight, w), args)
        return out

    def linear_residual_add_fp8(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """residual += linear_fp8(quantize_fp8(x), weight, weight_scale) in place (one
        kernel); returns residual."""
        op = "linear_residual_add_fp8"
        m, n = self._check_gemv8(op, x, "x", weight, weight_scale)
        self._check(op, "residual", residual, (m, n), x.dtype)
        if m == 0:
            return residual
        if not self._gemv8_fused(m, x.shape[1]):
            y = self.linear_fp8(self.quantize_fp8(x), weight, weight_scale, None, x.dtype)
            return residual.add_(y)
        args = (_p(x), _p(weight), _p(weight_scale), _p(residual))
        self._gemv8("gemv8_add", 2, x, n, (x, weight), args)
        return residual
