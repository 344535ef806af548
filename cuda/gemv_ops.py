"""Fused small-step ops of the CudaBackend (cuda/gemv.cu): launch plans and the three ops.

``norm_linear`` (RMSNorm + qkv), ``norm_gate_up_silu`` (RMSNorm + gate/up + SiLU·mul) and
``linear_residual_add`` (o_proj / down + residual add in place) serve steps of at most
``GEMV_MAX_TOKENS`` token rows: one CTA of ``GEMV_THREADS`` per SM (never more CTAs than
weight units), the activations staged in shared memory in chunks of at most
``GEMV_SMEM_BYTES`` (set once per kernel as its dynamic shared-memory limit, on first use,
so an eager warm-up step does it before any graph capture).

``GemvOps`` is a mixin: the class using it provides ``device``, ``_lib(dtype)``,
``_launch(kernel, grid, block, args, shared_mem)``, ``_sm_count``, ``_gemv_smem`` and the
``_gemv_kernels`` cache (CudaBackend does).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.launch_args import aligned as _aligned
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p

GEMV_MAX_TOKENS = 8  # gemv.cu kernels exist for M = 1..8 token rows
# Default small-step threshold. Measured on the H200 (8B shapes, graph replays, 2026-11-30):
# the four fused GEMVs of a layer beat cuBLAS + our norm/SiLU kernels up to M = 4 and lose
# at M = 8 (0.167 vs 0.134 ms for the GEMMs alone), so steps of 5..8 tokens stay unfused.
FUSED_DECODE_DEFAULT = 4
GEMV_THREADS = 512  # gemv.cu block: 16 warps, one weight unit (R rows) per warp at a time
GEMV_SMEM_BYTES = 192 * 1024  # most float32 activations staged per CTA (M x KC columns)
_GEMV_MODES = {"gemv_norm": 0, "gemv_norm_silu": 1, "gemv_add": 2}


def gemv_rows(m: int, mode: int) -> int:
    """Weight rows per warp unit in gemv.cu (``gemv_rows<M, MODE>``)."""
    if mode == 1:
        return 2 if m <= 4 else 4
    return 1 if m <= 2 else 2 if m <= 4 else 4


def gemv_chunk(m: int, k: int, budget: int = GEMV_SMEM_BYTES) -> int:
    """Columns staged in shared memory per chunk: all of K when M * K floats fit ``budget``
    bytes, else the largest multiple of 256 that does."""
    if m * k * 4 <= budget:
        return k
    return budget // (4 * m) // 256 * 256


def gemv_grid(m: int, mode: int, n_out: int, sm_count: int) -> int:
    """CTAs of a gemv.cu launch: one per SM, never more than the warp units (R rows each;
    for gate_up, R / 2 outputs) so that every CTA has work."""
    rows = gemv_rows(m, mode)
    units = math.ceil(n_out / (rows // 2 if mode == 1 else rows))
    return max(1, min(sm_count, units))


def check_token_rows(op: str, m: int) -> None:
    """The fused small-step kernels exist for at most GEMV_MAX_TOKENS token rows."""
    if m > GEMV_MAX_TOKENS:
        raise UnsupportedError(
            f"CudaBackend.{op}: {m} token rows; the fused gemv kernels take at most "
            f"{GEMV_MAX_TOKENS} (use the unfused ops for larger steps)"
        )


class GemvOps:
    """The fused small-step ops (mixin; see the module docstring for what it needs)."""

    device: torch.device
    _sm_count: int
    _gemv_smem: int
    _gemv_kernels: dict[tuple[torch.dtype, str], Any]
    _lib: Any
    _launch: Any

    def _gemv(
        self,
        family: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        n_out: int,
        aligned: tuple[torch.Tensor, ...],
        args: tuple,
    ) -> None:
        """Launch ``family``_m<M> for x [M, K] against weight [rows, K], ``n_out`` outputs;
        ``args`` go between the pointer arguments and (N, K, KC)."""
        m, k = x.shape
        check_token_rows(family, m)
        vec_ok = k % (16 // x.element_size()) == 0 and _aligned(*aligned)
        name = f"{family}_m{m}" + ("" if vec_ok else "_scalar")
        kern = self._gemv_kernels.get((x.dtype, name))
        if kern is None:
            kern = self._lib(x.dtype).get("gemv", name)
            kern.max_dynamic_shared_size_bytes = self._gemv_smem
            self._gemv_kernels[(x.dtype, name)] = kern
        grid = gemv_grid(m, _GEMV_MODES[family], n_out, self._sm_count)
        kc = gemv_chunk(m, k, self._gemv_smem)
        full = args + (_i(n_out), _i(k), _i(kc))
        self._launch(kern, (grid,), (GEMV_THREADS,), full, shared_mem=m * kc * 4, pdl=True)

    def _check_gemv(
        self, op: str, x: torch.Tensor, weight: torch.Tensor, x_name: str
    ) -> tuple[int, int]:
        """(M, N) of x [M, K] against weight [N, K]; both contiguous CUDA, one dtype."""
        _need(x, x_name)
        _need(weight, "weight", x.dtype)
        if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
            raise UnsupportedError(
                f"CudaBackend.{op}: {x_name} {list(x.shape)} and weight {list(weight.shape)} "
                f"do not chain ([M, K] x [N, K])"
            )
        return x.shape[0], weight.shape[0]

    def _check(self, op: str, name: str, t: torch.Tensor, shape: tuple, dtype) -> torch.Tensor:
        _need(t, name, dtype)
        if tuple(t.shape) != shape:
            raise UnsupportedError(
                f"CudaBackend.{op}: {name} has shape {list(t.shape)}, expected {list(shape)}"
            )
        return t

    def _linear_out(
        self,
        op: str,
        m: int,
        n: int,
        bias: torch.Tensor | None,
        out: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The [M, N] output of a linear with an optional bias [N] (allocated when None)."""
        if bias is not None:
            self._check(op, "bias", bias, (n,), dtype)
        if out is None:
            out = torch.empty(m, n, dtype=dtype, device=self.device)
        self._check(op, "out", out, (m, n), dtype)
        return out

    def _gate_up_out(
        self, op: str, m: int, n2: int, out: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The [M, I] output of a gate | up weight of n2 = 2I rows (allocated when None)."""
        if n2 % 2:
            raise UnsupportedError(
                f"CudaBackend.{op}: gate_up weight has {n2} rows; expected gate | up (even)"
            )
        if out is None:
            out = torch.empty(m, n2 // 2, dtype=dtype, device=self.device)
        self._check(op, "out", out, (m, n2 // 2), dtype)
        return out

    def norm_linear(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """linear(rms_norm(residual, norm_weight), weight, bias) in one kernel (M <= 8)."""
        op, dt = "norm_linear", residual.dtype
        m, n = self._check_gemv(op, residual, weight, "residual")
        self._check(op, "norm weight", norm_weight, (residual.shape[1],), dt)
        out = self._linear_out(op, m, n, bias, out, dt)
        if m == 0:
            return out
        args = (
            _p(residual), _p(norm_weight), np.float32(eps), _p(weight),
            _p(bias) if bias is not None else np.uint64(0), _p(out),
        )  # fmt: skip
        self._gemv("gemv_norm", residual, weight, n, (residual, norm_weight, weight), args)
        return out

    def norm_gate_up_silu(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu_and_mul(linear(rms_norm(residual), gate_up_weight)) in one kernel (M <= 8)."""
        op, dt, w = "norm_gate_up_silu", residual.dtype, gate_up_weight
        m, n2 = self._check_gemv(op, residual, w, "residual")
        self._check(op, "norm weight", norm_weight, (residual.shape[1],), dt)
        out = self._gate_up_out(op, m, n2, out, dt)
        if m == 0:
            return out
        args = (_p(residual), _p(norm_weight), np.float32(eps), _p(w), _p(out))
        self._gemv("gemv_norm_silu", residual, w, n2 // 2, (residual, norm_weight, w), args)
        return out

    def linear_residual_add(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """residual += linear(x, weight) in place (one kernel, M <= 8); returns residual."""
        m, n = self._check_gemv("linear_residual_add", x, weight, "x")
        self._check("linear_residual_add", "residual", residual, (m, n), x.dtype)
        if m == 0:
            return residual
        self._gemv("gemv_add", x, weight, n, (x, weight), (_p(x), _p(weight), _p(residual)))
        return residual
