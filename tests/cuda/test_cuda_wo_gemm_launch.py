"""The CudaBackend's large-step weight-only launches on the CPU, recorded instead of run
(tests/helpers/gemv_launch.py): under each ``wo_gemm`` choice the kernel that runs
(gemm_wo.cu's tile, gemm_wo_sm90.cu, or dequantize-then-cuBLAS's wo_rows_kernel), the
arguments against the C signature of both files (GW_PARAMS in cuda/gemm_wo.cuh), the flags
(f32 scales, float32 out), grid, block, shared memory and its attribute, a fused op's
unfused sequence reaching the same plan, and a bad plan name refused."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from helpers.gemv_launch import NP_TYPE, aligned, recording_backend
from helpers.packed_weights import random_packed
from llmc.base.errors import UnsupportedError
from llmc.cuda import gemm_wo_ops as gw
from llmc.cuda import gemv_wo_ops as wo
from llmc.cuda.kernels import CUDA_DIR

_TEXT = (CUDA_DIR / "gemm_wo.cuh").read_text().replace("\\\n", " ")
GW_SIG = [
    re.sub(r"\*\s*__restrict__", "*", p).strip().rsplit(" ", 1)[0].replace(" *", "*")
    for p in re.search(r"#define GW_PARAMS(.*?)\n", _TEXT).group(1).split(",")
]


@pytest.fixture
def be(monkeypatch):
    monkeypatch.setattr(wo, "_need", lambda t, name, dtype=None: None)
    b = recording_backend(monkeypatch)
    b.wo_gemv_passes = (1, 1)
    return b


def check(launch: tuple, family: str, name: str) -> tuple:
    kern, grid, block, args, smem = launch
    assert (kern.family, kern.name) == (family, name)
    assert len(args) == len(GW_SIG) == 13
    for a, ty in zip(args, GW_SIG, strict=True):
        assert type(a) is (np.uint64 if "*" in ty else NP_TYPE[ty]), (ty, type(a))
    assert block == (gw.GS_THREADS if family == "gemm_wo_sm90" else gw.GW_THREADS,)
    want_attr = smem if smem > gw.GW_STATIC_SMEM else 0
    assert kern.max_dynamic_shared_size_bytes == want_attr
    return grid, args, smem


def test_signature_parsed():
    assert GW_SIG[:6] == ["const scalar_t*", "const unsigned char*", "const void*",
                          "const void*", "const scalar_t*", "void*"]  # fmt: skip
    assert GW_SIG[6:] == ["int"] * 7


def test_mma_launch(be):
    be.wo_gemm = "mma"
    w = random_packed(300, 256, 4, 128, offsets=True)
    x, b, out = aligned(40, 256), aligned(300), aligned(40, 300, dtype=torch.float32)
    assert be.linear(x, w, b, out=out) is out
    grid, args, smem = check(be.launches[-1], "gemm_wo", "gemm_wo4_32x64")  # few 64x128 tiles
    assert grid == (2 * 5,) and smem == gw.gw_smem_bytes(4, 32, 64)
    assert int(args[0]) == x.data_ptr() and int(args[4]) == b.data_ptr()
    assert int(args[5]) == out.data_ptr()
    assert args[6:] == (40, 300, 256, 0, 128, 2, 2)  # M N K code_zero gs G, flags: f32 out
    w8 = random_packed(4096, 512, 8, 512, offsets=False, scale_dtype=torch.float32)
    be.linear(aligned(1000, 512), w8, out=aligned(1000, 4096))
    grid, args, smem = check(be.launches[-1], "gemm_wo", "gemm_wo8_128x128")
    assert grid == (8 * 32,) and int(args[3]) == 0 and args[-1] == 1 | 4  # f32 scales, row-scaled


def test_sm90_launch(be):
    w = random_packed(640, 1024, 8, 32, offsets=True)
    x, out = aligned(300, 1024), aligned(300, 640)
    be._wo_gemm("sm90", x, w, None, out)
    grid, args, smem = check(be.launches[-1], "gemm_wo_sm90", "gemm_wo8_sm90")
    assert grid == (3 * 5,) and smem == gw.gs_smem_bytes(8) and args[6:9] == (300, 640, 1024)
    w8 = random_packed(640, 1024, 8, 1024, offsets=False)  # int8_wo: never row-scaled here
    be._wo_gemm("sm90", x, w8, None, out)
    assert be.launches[-1][3][-1] == 0
    be._wo_gemm("mma", x, w8, None, out)
    assert be.launches[-1][3][-1] == 4


def test_plans_and_fallbacks(be):
    w = random_packed(256, 512, 4, 64, offsets=False)
    x = aligned(64, 512)
    assert be.wo_gemm == "auto"  # the default: the table (a narrow weight dequantizes)
    be.linear(x, w, out=aligned(64, 256))
    assert [lk[0].family for lk in be.launches] == ["wo_dequant"]
    wide = random_packed(16384, 512, 4, 64, offsets=False)  # gate_up-wide: mma to 64 rows
    be.linear(x, wide, out=aligned(64, 16384))
    assert be.launches[-1][0].family == "gemm_wo"
    be.linear(aligned(65, 512), wide, out=aligned(65, 16384))
    assert be.launches[-1][0].family == "wo_dequant"
    be.wo_gemm = "dequant"
    be.linear(x, wide, out=aligned(64, 16384))
    assert be.launches[-1][0].family == "wo_dequant"
    be.wo_gemm = "sm90"  # no sm_90 device (CPU): mma
    be.linear(x, w, out=aligned(64, 256))
    assert be.launches[-1][0].family == "gemm_wo"
    be.wo_gemm = "mma"  # a shape the kernels do not take: dequantize
    w_odd = random_packed(256, 80, 8, 16, offsets=False)
    be.linear(aligned(64, 80), w_odd, out=aligned(64, 256))
    assert be.launches[-1][0].family == "wo_dequant"
    be.wo_gemm = "tensor"
    with pytest.raises(UnsupportedError, match="wo_gemm = 'tensor'"):
        be.linear(x, w, out=aligned(64, 256))


def test_fused_ops_past_the_staging_budget_reach_the_plan(be):
    """down at M = 8 (8 x 28736 staged bytes exceed the budget): linear_residual_add runs
    its unfused sequence, whose linear takes the large-step plan."""
    be.wo_gemm = "mma"
    k, n = 14336, 64
    w = random_packed(n, k, 4, 128, offsets=True)
    assert wo.wo_smem_bytes(4, k, 128, 8, True) > be._gemv_smem - wo.WO_SMEM_MARGIN
    be.linear_residual_add(aligned(8, k), w, aligned(8, n))
    grid, args, _ = check(be.launches[-1], "gemm_wo", "gemm_wo4_32x64")
    assert grid == (1,) and args[6:9] == (8, n, k)
