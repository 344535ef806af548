"""CudaBackend's gemv launches on the CPU, with the launch recorded instead of run: the
kernel chosen (vector or *_scalar), the argument list against the kernel's C signature in
cuda/gemv.cu (count and types: pointers as uint64, float as float32, int as int32), grid,
chunk and shared memory, and every input check (M > 8, shapes, dtypes)."""

from __future__ import annotations

import pytest
import torch

from helpers.gemv_launch import aligned, check_args, kernel_signatures, recording_backend
from llmc.base.errors import ConfigError, UnsupportedError
from llmc.cuda import cuda_backend as cb
from llmc.cuda import gemv_ops as go

SIGS = kernel_signatures("gemv.cu", "GEMV_KERNELS", "GEMV_INSTANTIATE")


@pytest.fixture
def be(monkeypatch):
    return recording_backend(monkeypatch)


def test_signatures_parsed():
    sigs = SIGS
    assert set(sigs) == {"gemv_norm", "gemv_norm_silu", "gemv_add"}
    assert len(sigs["gemv_norm"]) == 9 and len(sigs["gemv_add"]) == 6


@pytest.mark.parametrize("m", [1, 5, 8])
def test_launches_match_the_kernel_signatures(be, m):
    k, n, i = 4096, 6144, 14336
    res, nw = aligned(m, k), aligned(k)
    be.norm_linear(res, nw, 1e-5, aligned(n, k), aligned(n), out=aligned(m, n))
    kern, grid, args, smem = check_args(be.launches[-1], SIGS["gemv_norm"], "gemv_norm")
    assert kern.family == "gemv" and kern.name == f"gemv_norm_m{m}"
    assert kern.max_dynamic_shared_size_bytes > 0
    assert args[-3:] == (n, k, k) and smem == m * k * 4 and grid == (132,)
    be.norm_gate_up_silu(res, nw, 1e-5, aligned(2 * i, k), out=aligned(m, i))
    kern, grid, args, _ = check_args(be.launches[-1], SIGS["gemv_norm_silu"], "gemv_norm_silu")
    assert kern.name == f"gemv_norm_silu_m{m}" and args[-3] == i
    act, resid = aligned(m, i), aligned(m, k)
    assert be.linear_residual_add(act, aligned(k, i), resid) is resid
    kern, grid, args, smem = check_args(be.launches[-1], SIGS["gemv_add"], "gemv_add")
    kc = go.gemv_chunk(m, i)
    assert kern.name == f"gemv_add_m{m}" and args[-3:] == (k, i, kc) and smem == m * kc * 4
    assert smem <= go.GEMV_SMEM_BYTES and (kc == i or kc % 256 == 0)


def test_scalar_kernels_for_odd_k_or_misaligned_bases(be):
    m, k, n = 2, 1004, 77
    be.norm_linear(aligned(m, k), aligned(k), 1e-5, aligned(n, k))
    assert be.launches[-1][0].name == "gemv_norm_m2_scalar"
    base = aligned(m * 512 + 1)
    be.linear_residual_add(base[1:].view(m, 512), aligned(n, 512), aligned(m, n))
    assert be.launches[-1][0].name == "gemv_add_m2_scalar"
    be.linear_residual_add(
        aligned(m, 1004, dtype=torch.float32),
        aligned(n, 1004, dtype=torch.float32),
        aligned(m, n, dtype=torch.float32),
    )
    assert be.launches[-1][0].name == "gemv_add_m2"  # 1004 % 4 == 0: float32 vectors


def test_grid_and_chunks():
    assert go.gemv_grid(1, 0, 6144, 132) == 132
    assert go.gemv_grid(8, 2, 5, 132) == 2  # R = 4: 2 units
    assert go.gemv_grid(8, 1, 9, 132) == 5  # gate_up at M = 8: 2 outputs per unit
    assert go.gemv_chunk(8, 4096) == 4096
    assert go.gemv_chunk(8, 14336) == 6144 and go.gemv_chunk(2, 14336) == 14336


def test_input_errors(be):
    k, n = 256, 64
    r9, nw, w = aligned(9, k), aligned(k), aligned(n, k)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.norm_linear(r9, nw, 1e-5, w)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.linear_residual_add(r9, w, aligned(9, n))
    r8 = r9[:8]
    with pytest.raises(UnsupportedError, match="do not chain"):
        be.norm_linear(r8, nw, 1e-5, aligned(n, k + 8))
    with pytest.raises(UnsupportedError, match="norm weight has shape"):
        be.norm_gate_up_silu(r8, nw[:-8], 1e-5, aligned(2 * n, k))
    with pytest.raises(UnsupportedError, match="out has shape"):
        be.norm_linear(r8, nw, 1e-5, w, out=aligned(8, n + 1))
    with pytest.raises(UnsupportedError, match="bias has shape"):
        be.norm_linear(r8, nw, 1e-5, w, aligned(n + 1))
    with pytest.raises(UnsupportedError, match="even"):
        be.norm_gate_up_silu(r8, nw, 1e-5, aligned(2 * n + 1, k))
    with pytest.raises(UnsupportedError, match="residual has shape"):
        be.linear_residual_add(r8, w, aligned(8, n + 1))
    with pytest.raises(UnsupportedError, match="weight must be"):
        be.norm_linear(r8, nw, 1e-5, w.float())
    assert be.norm_linear(r8[:0], nw, 1e-5, w).shape == (0, n) and not be.launches


def test_fused_decode_max_tokens_range():
    for bad in (9, -1, 2.0, True):
        with pytest.raises(ConfigError, match="fused_decode_max_tokens"):
            cb.CudaBackend("cuda", fused_decode_max_tokens=bad)
