"""The torch reference of llmc's FP8 ops: W8A8 linear layers and the quantizing epilogues.

FP8 here is float8_e4m3fn (largest finite value 448). The recipes are exact integer-free
float32 formulas so a CUDA kernel can reproduce them bit for bit:

- Activations are quantized per row (per token), dynamically: ``amax = max(max|x_row|,
  MIN_AMAX)``, ``inv = 448 / amax`` (float32 division), ``q = sat(x * inv)`` cast to e4m3
  with round-to-nearest-even (``sat`` clamps to ±448), ``scale = amax / 448``; the row's real
  values are ``q * scale``. The input is first rounded to the activation dtype where a
  fusion produces it (rms_norm, silu·mul), so ``rms_norm_fp8 == quantize_fp8(rms_norm)``.
- Weights are quantized per output channel at build time (``quantize_weight_fp8``): the same
  recipe along each row of ``weight [out, in]``.
- ``linear_fp8``: ``(q_x @ q_w.T)`` accumulated in float32 (fp8 products are exact in
  float32), times ``x.scale[t] * weight_scale[n]``, plus bias, rounded once to ``dtype``.
- The KV cache in e4m3 uses one float32 scale per layer for K and one for V (static:
  1.0 unless the checkpoint brings calibrated scales): written as ``sat(k * float32(1 /
  k_scale))``, read as ``k_fp8 * k_scale`` (``llmc.cuda.reference.rope_and_cache_write``
  and ``paged_attention`` take the scales).

Small-step fusions (``norm_linear_fp8``, ``norm_gate_up_silu_fp8``,
``linear_residual_add_fp8``) compose the ops above exactly as their BF16 counterparts in
``llmc.cuda.reference`` compose theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.cuda import reference as ref

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
"""Floor of a row's amax, so an all-zero row gets a finite scale (its codes are all 0)."""


@dataclass
class Fp8Rows:
    """Rows quantized to e4m3 with one float32 scale per row: real value = q * scale[:, None]."""

    q: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """[T, K] float32."""
        return self.q.float() * self.scale[:, None]

    def copy_(self, other: Fp8Rows) -> Fp8Rows:
        self.q.copy_(other.q)
        self.scale.copy_(other.scale)
        return self

    def view(self, shape: torch.Size) -> Fp8Rows:
        return Fp8Rows(self.q.view(shape), self.scale)


def saturate_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 → e4m3, values beyond ±448 clamped, round to nearest even (CUDA's
    ``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)``)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(x: torch.Tensor) -> Fp8Rows:
    """x [T, K] (any float dtype) → per-row dynamic e4m3 quantization (recipe above)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=MIN_AMAX) if xf.shape[-1] else xf.new_ones(len(xf))
    inv = FP8_MAX / amax
    return Fp8Rows(saturate_to_fp8(xf * inv[:, None]), amax / FP8_MAX)


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] → (e4m3 [out, in], float32 scale [out]): per output channel."""
    rows = quantize_fp8(weight)
    return rows.q, rows.scale


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """quantize_fp8(rms_norm(x, weight, eps)): the qkv and gate_up input."""
    return quantize_fp8(ref.rms_norm(x, weight, eps))


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Rows, torch.Tensor]:
    """residual += x (in place); returns (quantize_fp8(rms_norm(residual)), residual)."""
    normed, residual = ref.add_rms_norm(x, residual, weight, eps)
    return quantize_fp8(normed), residual


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """quantize_fp8(silu_and_mul(x)): the down-projection input."""
    return quantize_fp8(ref.silu_and_mul(x))


def linear_fp8(
    x: Fp8Rows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W8A8: x [T, in] (Fp8Rows), weight [out, in] e4m3, weight_scale [out] float32 →
    ``(q_x @ q_w.T) * x.scale[:, None] * weight_scale[None, :] (+ bias)`` in ``dtype``."""
    acc = x.q.float() @ weight.float().t()
    out = acc * x.scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def norm_linear_fp8(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear_fp8(rms_norm_fp8(residual), ...) in residual's dtype (the qkv path)."""
    x = rms_norm_fp8(residual, norm_weight, eps)
    return linear_fp8(x, weight, weight_scale, bias, residual.dtype)


def norm_gate_up_silu_fp8(
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
) -> torch.Tensor:
    """silu_and_mul(linear_fp8(rms_norm_fp8(residual), gate_up)) in residual's dtype."""
    x = rms_norm_fp8(residual, norm_weight, eps)
    return ref.silu_and_mul(linear_fp8(x, gate_up_weight, gate_up_scale, None, residual.dtype))


def linear_residual_add_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """residual += linear_fp8(quantize_fp8(x), weight) (in place); returns residual."""
    return residual.add_(linear_fp8(quantize_fp8(x), weight, weight_scale, None, residual.dtype))
