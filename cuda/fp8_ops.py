"""Fp8Ops: the CudaBackend's FP8 (W8A8) ops — quantizing epilogues and scaled GEMMs.

The recipes and their torch reference are ``llmc.cuda.reference_fp8``. Activations are
quantized per row by the kernel that produces them, in its epilogue: ``rms_norm_fp8`` /
``add_rms_norm_fp8`` (cuda/rmsnorm.cu), ``silu_and_mul_fp8`` (cuda/activation.cu), and
``quantize_fp8`` (cuda/quantize.cu) for the attention output that feeds o_proj. Their codes
are the reference recipe applied to the values the BF16 kernels compute, bit for bit.

GEMMs run through ``torch._scaled_mm`` with row-wise scales (cuBLASLt on sm_90 with CUDA
12.9+, CUTLASS otherwise): e4m3 activations [T, K] with one float32 scale per row times the
e4m3 weight [N, K] (column-major as ``weight.t()``) with one scale per output channel,
written into ``out`` (its ``out=`` form: nothing allocated per step, capturable in a CUDA
graph). The bias is added in the same call for 16-bit outputs (torch refuses a bias with a
float32 output: there it is a second, in-place add). K and N must be multiples of 16.
``Fp8Ops.fp8_fast_accum`` (on by default, as vLLM's CUTLASS FP8 kernels) passes
``use_fast_accum``: Hopper's fp8 MMAs then accumulate the whole K in their reduced-precision
accumulator instead of promoting partial sums to float32 every few k-steps. Measured on an
H100 (2026-12-07, scripts/fp8_gemm_sweep.py, M = 1,024): the 8B GEMMs 1,192-1,380 ->
1,309-1,432 TFLOP/s, the error against the float32 product of the same codes 0.3 % -> 0.6-1.1 %
of the largest output (K = 14,336 the most); the FP8 128/128 row +7.6-8.0 %
(docs/PERFORMANCE.md).

``Fp8Ops`` is a mixin: the class using it provides ``device``, ``_lib(dtype)``,
``_launch(kernel, grid, block, args)``, ``_rms`` and the BF16 ``silu_and_mul`` (CudaBackend).
"""

from __future__ import annotations

from typing import Any

import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.launch_args import aligned as _aligned
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p
from llmc.cuda.launch_args import row_block
from llmc.cuda.reference_fp8 import FP8_DTYPE, FP8_MAX, Fp8Rows

ROW_VPT = 4  # 16-byte vectors per thread held in registers (SILU_VPT, QUANT_VPT)
_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8Ops:
    """Mixin of CudaBackend (see the module docstring for what it needs)."""

    device: torch.device
    _lib: Any
    _launch: Any
    _rms: Any
    silu_and_mul: Any
    fp8_fast_accum: bool = True  # use_fast_accum of the FP8 GEMMs (the module docstring)

    def _fp8_rows(self, out: Fp8Rows | None, t: int, k: int, op: str) -> Fp8Rows:
        """``out`` checked to hold [t, k] e4m3 codes and [t] float32 scales, or new rows."""
        if out is None:
            return Fp8Rows(
                torch.empty(t, k, dtype=FP8_DTYPE, device=self.device),
                torch.empty(t, dtype=torch.float32, device=self.device),
            )
        if not isinstance(out, Fp8Rows):
            raise UnsupportedError(f"CudaBackend.{op}: out must be an Fp8Rows, got {type(out)}")
        _need(out.q, f"{op} out.q", FP8_DTYPE)
        _need(out.scale, f"{op} out.scale", torch.float32)
        if tuple(out.q.shape) != (t, k) or tuple(out.scale.shape) != (t,):
            raise UnsupportedError(
                f"CudaBackend.{op}: out holds {tuple(out.q.shape)} codes and "
                f"{tuple(out.scale.shape)} scales, the result is ({t}, {k}) and ({t},)"
            )
        return out

    def _row_fp8(self, family: str, name: str, x: torch.Tensor, rows: Fp8Rows, k: int) -> None:
        """Launch a one-CTA-per-row quantizing kernel (x [T, .], rows [T, k])."""
        t = rows.q.shape[0]
        vec = 16 // x.element_size()
        vec_ok = k % vec == 0 and _aligned(x, rows.q)
        # 512 threads at most: 1,024-thread launches (16-bit rows of 40,000, or 14,336 on the
        # unaligned path) asked for more registers than an SM has and were refused on the
        # H200; longer rows loop over the kernel's tail
        block = row_block(k // vec if vec_ok else k, ROW_VPT, most=512)
        kern = self._lib(x.dtype).get(family, name)
        args = (_p(x), _p(rows.q), _p(rows.scale), _i(t), _i(k), _i(vec_ok))
        self._launch(kern, (min(t, 65535),), (block,), args)

    def quantize_fp8(self, x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
        _need(x, "x")
        t, k = x.shape
        rows = self._fp8_rows(out, t, k, "quantize_fp8")
        if t and not k:  # no values: the reference's scale of an empty row
            rows.scale.fill_(1.0).div_(FP8_MAX)
        elif t:
            self._row_fp8("quantize", "quantize_fp8_kernel", x, rows, k)
        return rows

    def rms_norm_fp8(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: Fp8Rows | None = None
    ) -> Fp8Rows:
        _need(x, "x")
        rows = self._fp8_rows(out, x.shape[0], x.shape[1], "rms_norm_fp8")
        return self._rms(x, None, weight, eps, None, rows)

    def add_rms_norm_fp8(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: Fp8Rows | None = None,
    ) -> tuple[Fp8Rows, torch.Tensor]:
        _need(x, "x")
        _need(residual, "residual", x.dtype)
        rows = self._fp8_rows(out, x.shape[0], x.shape[1], "add_rms_norm_fp8")
        return self._rms(x, residual, weight, eps, None, rows), residual

    def silu_and_mul_fp8(self, x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
        _need(x, "x")
        t, i = x.shape[0], x.shape[1] // 2
        rows = self._fp8_rows(out, t, i, "silu_and_mul_fp8")
        if t and i:
            self._row_fp8("activation", "silu_and_mul_fp8_kernel", x, rows, i)
        elif t:
            rows.scale.fill_(1.0).div_(FP8_MAX)
        return rows

    def linear_fp8(
        self,
        x: Fp8Rows,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(x, Fp8Rows):
            raise UnsupportedError(f"CudaBackend.linear_fp8: x must be an Fp8Rows, got {type(x)}")
        _need(x.q, "linear_fp8 x.q", FP8_DTYPE)
        _need(x.scale, "linear_fp8 x.scale", torch.float32)
        _need(weight, "linear_fp8 weight", FP8_DTYPE)
        _need(weight_scale, "linear_fp8 weight_scale", torch.float32)
        if dtype not in _MM_DTYPES:
            raise UnsupportedError(f"CudaBackend.linear_fp8: output dtype {dtype} is not supported")
        t, k = x.q.shape
        n = weight.shape[0]
        if weight.shape[1] != k or tuple(weight_scale.shape) != (n,) or x.scale.shape != (t,):
            raise UnsupportedError(
                f"CudaBackend.linear_fp8: x {tuple(x.q.shape)} (scales {tuple(x.scale.shape)}), "
                f"weight {tuple(weight.shape)} (scales {tuple(weight_scale.shape)}) do not match"
            )
        if k % 16 or n % 16:
            raise UnsupportedError(
                f"CudaBackend.linear_fp8: FP8 GEMMs need in/out features that are multiples of "
                f"16, got weight {tuple(weight.shape)}"
            )
        if bias is not None:
            _need(bias, "linear_fp8 bias", dtype)
        if out is None:
            out = torch.empty(t, n, dtype=dtype, device=self.device)
        else:
            _need(out, "linear_fp8 out", dtype)
        if t == 0:
            return out
        fused_bias = bias if dtype != torch.float32 else None
        torch._scaled_mm(
            x.q,
            weight.t(),
            scale_a=x.scale.view(t, 1),
            scale_b=weight_scale.view(1, n),
            bias=fused_bias,
            out_dtype=dtype,
            use_fast_accum=self.fp8_fast_accum,
            out=out.view(t, n),
        )
        if bias is not None and fused_bias is None:
            out.add_(bias)
        return out
