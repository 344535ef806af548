"""CudaBackend's fused FP8 gemv launches (cuda/gemv_fp8_ops.py) on the CPU, the launch
recorded instead of run: the kernel chosen (vector or *_scalar), the argument list against
the kernel's C signature in cuda/gemv_fp8.cu (count and types), grid, row stride and shared
memory, the unfused fallback past the staging budget, and every input check."""

from __future__ import annotations

import pytest
import torch

from helpers.gemv_launch import aligned, check_args, kernel_signatures, recording_backend
from llmc.base.errors import UnsupportedError
from llmc.cuda import gemv_fp8_ops as g8

FP8 = torch.float8_e4m3fn
SIGS = kernel_signatures("gemv_fp8.cu", "G8_KERNELS", "G8_INSTANTIATE")


@pytest.fixture
def be(monkeypatch):
    return recording_backend(monkeypatch)


def test_signatures_parsed():
    sigs = SIGS
    assert set(sigs) == {"gemv8_norm", "gemv8_norm_silu", "gemv8_add"}
    assert len(sigs["gemv8_norm"]) == 10 and len(sigs["gemv8_add"]) == 7
    assert sigs["gemv8_norm"][3] == "const unsigned char* __restrict__"


@pytest.mark.parametrize("m", [1, 5, 8])
def test_launches_match_the_kernel_signatures(be, m):
    k, n, i = 4096, 6144, 14336
    res, nw = aligned(m, k), aligned(k)
    ws = aligned(n, dtype=torch.float32)
    be.norm_linear_fp8(res, nw, 1e-5, aligned(n, k, dtype=FP8), ws, aligned(n), out=aligned(m, n))
    kern, grid, args, smem = check_args(be.launches[-1], SIGS["gemv8_norm"], "gemv8_norm")
    s = g8.gemv8_stride(k)
    assert kern.family == "gemv_fp8" and kern.name == f"gemv8_norm_m{m}"
    assert kern.max_dynamic_shared_size_bytes > 0
    assert args[-3:] == (n, k, s) and smem == m * s and grid == (132,)
    assert args[5] != 0  # bias pointer
    gu_scale = aligned(2 * i, dtype=torch.float32)
    be.norm_gate_up_silu_fp8(res, nw, 1e-5, aligned(2 * i, k, dtype=FP8), gu_scale, aligned(m, i))
    kern, grid, args, _ = check_args(be.launches[-1], SIGS["gemv8_norm_silu"], "gemv8_norm_silu")
    assert kern.name == f"gemv8_norm_silu_m{m}" and args[-3] == i and grid == (132,)
    act, resid = aligned(m, i), aligned(m, k)
    out = be.linear_residual_add_fp8(
        act, aligned(k, i, dtype=FP8), aligned(k, dtype=torch.float32), resid
    )
    assert out is resid
    kern, grid, args, smem = check_args(be.launches[-1], SIGS["gemv8_add"], "gemv8_add")
    s = g8.gemv8_stride(i)
    assert kern.name == f"gemv8_add_m{m}" and args[-3:] == (k, i, s) and smem == m * s
    assert smem <= kern.max_dynamic_shared_size_bytes == be._gemv8_budget()


def test_plan():
    assert g8.gemv8_stride(4096) == 4160 and g8.gemv8_stride(576) == 704
    assert g8.gemv8_stride(14336) % 128 == 64 and g8.gemv8_stride(1) == 192
    assert g8.gemv8_tiles(0, 6144) == 384 and g8.gemv8_tiles(1, 14336) == 1792
    assert g8.gemv8_tiles(2, 5) == 1 and g8.gemv8_tiles(1, 9) == 2
    assert g8.gemv8_grid(0, 6144, 132) == 132 and g8.gemv8_grid(2, 4096, 132) == 132
    assert g8.gemv8_grid(2, 40, 132) == 3 and g8.gemv8_grid(1, 20, 132) == 3


def test_scalar_kernels_for_odd_k_or_misaligned_bases(be):
    m, n = 2, 77
    ws = aligned(n, dtype=torch.float32)
    be.norm_linear_fp8(aligned(m, 1000), aligned(1000), 1e-5, aligned(n, 1000, dtype=FP8), ws)
    assert be.launches[-1][0].name == "gemv8_norm_m2_scalar"  # 1000 % 16 != 0
    be.norm_linear_fp8(aligned(m, 1008), aligned(1008), 1e-5, aligned(n, 1008, dtype=FP8), ws)
    assert be.launches[-1][0].name == "gemv8_norm_m2"  # K % 64 != 0 is fine for vectors
    base = aligned(m * 512 + 8)
    x = base[8:].view(m, 512)  # 16-byte aligned (8 bf16)
    be.linear_residual_add_fp8(x, aligned(n, 512, dtype=FP8), ws, aligned(m, n))
    assert be.launches[-1][0].name == "gemv8_add_m2"
    x = base[1:-7].view(m, 512)  # 2 bytes off
    be.linear_residual_add_fp8(x, aligned(n, 512, dtype=FP8), ws, aligned(m, n))
    assert be.launches[-1][0].name == "gemv8_add_m2_scalar"
    f32 = dict(dtype=torch.float32)
    be.linear_residual_add_fp8(
        aligned(m, 512, **f32), aligned(n, 512, dtype=FP8), ws, aligned(m, n, **f32)
    )
    assert be.launches[-1][0].name == "gemv8_add_m2"


def test_unfused_past_the_staging_budget(be):
    """M rows that do not fit the shared-memory budget run the unfused sequence."""
    calls = []
    be.rms_norm_fp8 = lambda x, w, eps: calls.append("rms_norm_fp8") or "x8"
    be.quantize_fp8 = lambda x: calls.append("quantize_fp8") or "x8"
    be.linear_fp8 = lambda x, w, s, b, dt, out=None: (
        calls.append(("linear_fp8", x, b))
        or (out if out is not None else torch.zeros(2, w.shape[0], dtype=dt))
    )
    be.silu_and_mul = lambda gu, out=None: calls.append("silu_and_mul") or out
    k = be._gemv8_budget() // 8  # 8 rows of stride > k do not fit
    res, nw = aligned(8, k), aligned(k)
    assert not be._gemv8_fused(8, k) and be._gemv8_fused(7, k)
    w, ws = aligned(32, k, dtype=FP8), aligned(32, dtype=torch.float32)
    out = aligned(8, 32)
    assert be.norm_linear_fp8(res, nw, 1e-5, w, ws, out=out) is out
    assert be.norm_gate_up_silu_fp8(res, nw, 1e-5, w, ws, out=aligned(8, 16)) is not None
    r = torch.ones(8, 32, dtype=torch.bfloat16)
    be.linear_fp8 = lambda x, w, s, b, dt, out=None: (
        calls.append("linear_fp8") or torch.ones(8, 32, dtype=dt)
    )
    assert be.linear_residual_add_fp8(res, w, ws, r) is r and bool((r == 2).all())
    assert calls == [
        "rms_norm_fp8", ("linear_fp8", "x8", None),
        "rms_norm_fp8", ("linear_fp8", "x8", None), "silu_and_mul",
        "quantize_fp8", "linear_fp8",
    ]  # fmt: skip
    assert not be.launches
    be.norm_linear_fp8(res[:7], nw, 1e-5, w, ws)
    assert be.launches[-1][0].name == "gemv8_norm_m7"


def test_input_errors(be):
    k, n = 256, 64
    r9, nw = aligned(9, k), aligned(k)
    w, ws = aligned(n, k, dtype=FP8), aligned(n, dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.norm_linear_fp8(r9, nw, 1e-5, w, ws)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.linear_residual_add_fp8(r9, w, ws, aligned(9, n))
    r8 = r9[:8]
    with pytest.raises(UnsupportedError, match="weight must be torch.float8_e4m3fn"):
        be.norm_linear_fp8(r8, nw, 1e-5, aligned(n, k), ws)
    with pytest.raises(UnsupportedError, match="weight scale must be torch.float32"):
        be.norm_linear_fp8(r8, nw, 1e-5, w, aligned(n))
    with pytest.raises(UnsupportedError, match="weight scale has shape"):
        be.linear_residual_add_fp8(r8, w, aligned(n + 1, dtype=torch.float32), aligned(8, n))
    with pytest.raises(UnsupportedError, match="do not chain"):
        be.norm_linear_fp8(r8, nw, 1e-5, aligned(n, k + 16, dtype=FP8), ws)
    with pytest.raises(UnsupportedError, match="norm weight has shape"):
        be.norm_gate_up_silu_fp8(
            r8, nw[:-8], 1e-5, aligned(2 * n, k, dtype=FP8), aligned(2 * n, dtype=torch.float32)
        )
    with pytest.raises(UnsupportedError, match="out has shape"):
        be.norm_linear_fp8(r8, nw, 1e-5, w, ws, out=aligned(8, n + 1))
    with pytest.raises(UnsupportedError, match="bias has shape"):
        be.norm_linear_fp8(r8, nw, 1e-5, w, ws, aligned(n + 1))
    with pytest.raises(UnsupportedError, match="even"):
        be.norm_gate_up_silu_fp8(
            r8, nw, 1e-5, aligned(2 * n + 1, k, dtype=FP8), aligned(2 * n + 1, dtype=torch.float32)
        )
    with pytest.raises(UnsupportedError, match="residual has shape"):
        be.linear_residual_add_fp8(r8, w, ws, aligned(8, n + 1))
    with pytest.raises(UnsupportedError, match="dtype torch.float64 is not supported"):
        be.linear_residual_add_fp8(aligned(8, k, dtype=torch.float64), w, ws, aligned(8, n))
    with pytest.raises(UnsupportedError, match="contiguous"):
        be.linear_residual_add_fp8(aligned(8, 2 * k)[:, ::2], w, ws, aligned(8, n))
    assert be.norm_linear_fp8(r8[:0], nw, 1e-5, w, ws).shape == (0, n) and not be.launches
