"""Fp8Ops: the CudaBackend's FP8 (W8A8) ops — quantizing epilogues and scaled GEMMs.

The recipes and their torch reference are ``llmc.cuda.reference_fp8``. GEMMs run through
``torch._scaled_mm`` (cuBLASLt / CUTLASS row-wise scaling on sm_89+): e4m3 activations
with one scale per row times e4m3 weights with one scale per output channel, BF16 out.

This first version quantizes with torch ops after the BF16 kernels (one extra pass over
the activation per quantization); the fused kernels that quantize in the producing
kernel's epilogue replace these methods one by one, keeping the signatures.
"""

from __future__ import annotations

from typing import Any

import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.reference_fp8 import Fp8Rows


def _store(out: Fp8Rows | None, value: Fp8Rows) -> Fp8Rows:
    if out is None:
        return value
    return out.copy_(value)


class Fp8Ops:
    """Mixin of CudaBackend: needs ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``."""

    device: torch.device
    rms_norm: Any
    add_rms_norm: Any
    silu_and_mul: Any

    def quantize_fp8(self, x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
        return _store(out, ref8.quantize_fp8(x))

    def rms_norm_fp8(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: Fp8Rows | None = None
    ) -> Fp8Rows:
        return _store(out, ref8.quantize_fp8(self.rms_norm(x, weight, eps)))

    def add_rms_norm_fp8(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: Fp8Rows | None = None,
    ) -> tuple[Fp8Rows, torch.Tensor]:
        normed, residual = self.add_rms_norm(x, residual, weight, eps)
        return _store(out, ref8.quantize_fp8(normed)), residual

    def silu_and_mul_fp8(self, x: torch.Tensor, out: Fp8Rows | None = None) -> Fp8Rows:
        return _store(out, ref8.quantize_fp8(self.silu_and_mul(x)))

    def linear_fp8(
        self,
        x: Fp8Rows,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if weight.dtype != ref8.FP8_DTYPE or x.q.dtype != ref8.FP8_DTYPE:
            raise UnsupportedError("CudaBackend.linear_fp8: weight and x must be float8_e4m3fn")
        t = x.q.shape[0]
        if out is None:
            out = torch.empty(t, weight.shape[0], dtype=dtype, device=self.device)
        if t == 0:
            return out
        # row-wise scaling gives BF16; another activation dtype is a cast of it
        y = torch._scaled_mm(
            x.q,
            weight.t(),
            scale_a=x.scale.view(t, 1),
            scale_b=weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )
        if bias is not None:
            y = y + bias.to(y.dtype)
        out.copy_(y)
        return out
