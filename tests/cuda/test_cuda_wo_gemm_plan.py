"""The plans of the weight-only linear for larger steps (llmc.cuda.gemm_wo_ops), on the CPU:
the tile each step size gets, the grid and shared memory of both tensor-core kernels, the
``wo_gemm`` table and choices, and the shapes that fall back to dequantize-then-cuBLAS.
The kernels themselves: tests/cuda/test_cuda_wo_gemm_emulated.py (CPU emulator) and
tests/cuda/test_cuda_wo_gemm.py (GPU)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from helpers.packed_weights import random_packed
from llmc.base.errors import UnsupportedError
from llmc.cuda.gemm_wo_ops import (
    gs_smem_bytes,
    gw_launch,
    gw_smem_bytes,
    gw_unsupported,
    wo_gemm_plan,
    wo_gemm_planned,
)
from llmc.cuda.wo_dequant_ops import WO_CHUNK_BYTES, wo_chunk_rows


def test_plan_picks_each_tile():
    """gw_launch's tiles: 32-row tiles for M <= 32, the largest tile filling 90 % of the
    SMs otherwise (the 8B shapes on 132 SMs), the grid covering M x N."""
    w = random_packed(4096, 64, 4, 32, offsets=False)
    cases = {(16, 132): "32x64", (64, 16): "64x128", (512, 132): "128x128", (256, 132): "64x128"}
    for (m, sms), tile in cases.items():
        x = torch.zeros(m, 64, dtype=torch.bfloat16)
        out = torch.empty(m, 4096, dtype=torch.bfloat16)
        _, name, grid, _, _ = gw_launch(x, w, None, out, sms)
        bm, bn = map(int, tile.split("x"))
        assert name == f"gemm_wo4_{tile}" and grid == -(-m // bm) * (4096 // bn)
    x = torch.zeros(300, 64, dtype=torch.bfloat16)
    fam, name, grid, smem, _ = gw_launch(x, w, None, torch.empty(300, 4096), 132, "sm90")
    assert (fam, name, grid) == ("gemm_wo_sm90", "gemm_wo4_sm90", 3 * 32)
    assert smem == gs_smem_bytes(4) <= 227 * 1024  # the H200's opt-in shared memory


def test_plan_table_and_choices():
    """wo_gemm: a plan everywhere, or ``auto`` by the table; sm90 is mma off sm_90; a bad
    name is refused."""
    # the measured rows (gemm_wo_ops.WO_GEMM_TABLE): mma for wide weights (gate_up) up to
    # 64 rows, dequantize-then-cuBLAS everywhere else
    for sm90 in (True, False):
        assert [wo_gemm_planned("auto", m, sm90, 28672) for m in (9, 64, 65, 1025)] == [
            "mma", "mma", "dequant", "dequant",
        ]  # fmt: skip
        assert {wo_gemm_planned("auto", m, sm90, n) for m in (9, 64, 65, 1025)
                for n in (0, 4096, 6144, 16383)} == {"dequant"}  # fmt: skip
    assert wo_gemm_planned("auto", 64, True, 16384) == "mma"
    assert wo_gemm_planned("mma", 32, True) == "mma"
    assert wo_gemm_planned("dequant", 16, True) == "dequant"
    assert wo_gemm_planned("sm90", 8192, True) == "sm90"
    with pytest.raises(UnsupportedError, match="wo_gemm = 'wgmma'"):
        wo_gemm_planned("wgmma", 16, True)


def test_unsupported_shapes_fall_back():
    w = random_packed(64, 96, 4, 32, offsets=True)
    x = torch.zeros(20, 96, dtype=torch.bfloat16)
    assert gw_unsupported(x, w) is None
    assert "float32" in gw_unsupported(x.float(), w)
    w2 = random_packed(64, 80, 8, 16, offsets=False)
    assert "multiple of 32" in gw_unsupported(torch.zeros(20, 80, dtype=torch.bfloat16), w2)
    w3 = random_packed(64, 96, 8, 12, offsets=False)
    assert "group size 12" in gw_unsupported(x, w3)
    x_u = torch.zeros(20 * 96 + 8, dtype=torch.bfloat16)[8:].view(20, 96)  # 16-byte offset: ok
    assert gw_unsupported(x_u, w) is None
    assert "16-byte" in gw_unsupported(
        torch.zeros(20 * 96 + 1, dtype=torch.bfloat16)[1:].view(20, 96), w
    )
    out_u = torch.zeros(20 * 64 + 1, dtype=torch.bfloat16)[1:].view(20, 64)
    assert "8-byte" in gw_unsupported(x, w, out_u)


def test_dequant_chunks_are_aligned():
    """Dequantize-then-cuBLAS chunks: whole multiples of 128 rows (each chunk's columns of
    out start 16-byte aligned: down_proj's 877-row chunks did not, 13 % of cuBLAS), split
    evenly, within the temporary's budget (+ one alignment step); every 8B projection is one
    chunk, lm_head several."""
    for n, k in ((4096, 14336), (28672, 4096), (6144, 4096), (20000, 4096), (128256, 4096)):
        rows = wo_chunk_rows(n, k, 2)
        assert (rows == n or rows % 128 == 0) and rows * k * 2 <= WO_CHUNK_BYTES + 128 * k * 2
        chunks = -(-n // rows)
        assert chunks == max(1, -(-n * k * 2 // WO_CHUNK_BYTES))
    assert wo_chunk_rows(4096, 14336, 2) == 4096 and wo_chunk_rows(28672, 4096, 2) == 28672
    assert wo_chunk_rows(4096, 14336, 2, 24 << 20) == 896  # 24 MB: five chunks, rounded to 128 rows
    assert wo_chunk_rows(128256, 4096, 2) == 32128  # four chunks
    assert wo_chunk_rows(97, 1152, 2) == 97 and wo_chunk_rows(20000, 4096, 2) == 20000  # one chunk


def test_plan_of_a_step():
    """wo_gemm_plan: auto follows the table (mma for a weight of >= 16,384 rows up to 64
    token rows, else dequantize); an explicit plan is kept where it applies; unsupported
    steps dequantize whatever the choice."""
    w = random_packed(4096, 128, 4, 128, offsets=True)
    wide = random_packed(16384, 64, 8, 64, offsets=False)
    x = torch.zeros(256, 128, dtype=torch.bfloat16)
    assert wo_gemm_plan("auto", torch.zeros(64, 128, dtype=torch.bfloat16), w, True) == "dequant"
    assert wo_gemm_plan("auto", torch.zeros(64, 64, dtype=torch.bfloat16), wide, False) == "mma"
    assert wo_gemm_plan("auto", torch.zeros(65, 64, dtype=torch.bfloat16), wide, True) == (
        "dequant"
    )
    assert wo_gemm_plan("auto", torch.zeros(64, 64), wide, True) == "dequant"  # float32 x
    assert wo_gemm_plan("mma", torch.zeros(64, 128, dtype=torch.bfloat16), w, True) == "mma"
    assert wo_gemm_plan("auto", x, w, True) == "dequant"
    assert wo_gemm_plan("sm90", x, w, True) == "sm90"  # an explicit choice is kept
    assert wo_gemm_plan("sm90", x, w, False) == "mma"
    assert wo_gemm_plan("mma", x.float(), w, True) == "dequant"
    assert wo_gemm_plan("auto", torch.zeros(2048, 128, dtype=torch.bfloat16), w, True) == (
        "dequant"
    )


def test_shared_memory_fits_two_ctas_an_sm():
    """gemm_wo.cu's stages are sized so two CTAs fit the H200's 228 KB an SM (1 KB of each
    reserved); gemm_wo_sm90.cu's one CTA fits the 227 KB opt-in limit."""
    for bits in (4, 8):
        for tile in ((128, 128), (64, 128), (32, 64)):
            assert 2 * (gw_smem_bytes(bits, *tile) + 1024) <= 228 * 1024
        assert gs_smem_bytes(bits) <= 227 * 1024


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_sm90_wgmma_pipeline_is_not_serialized(tmp_path):
    """ptxas serializes wgmma (info C7515, no warning: compile_check passes) when other
    instructions define accumulator registers inside the pipeline; it did once here, for
    an epilogue FMUL (gemm_wo.cuh's gw_store2<false> keeps it out)."""
    from llmc.cuda.build import arch_flags
    from llmc.cuda.kernels import KernelConfig, source

    for dtype in ("bfloat16", "float16"):
        cu = tmp_path / f"gemm_wo_sm90_{dtype}.cu"
        cu.write_text(source("gemm_wo_sm90", KernelConfig(dtype, 128, 32, 8)))
        cmd = ["nvcc", "-std=c++17", "-O3", *arch_flags("sm_90a"), "-cubin", "-Xptxas", "-v",
               str(cu), "-o", str(cu.with_suffix(".cubin"))]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "C7515" not in res.stderr and "serialized" not in res.stderr, res.stderr[-3000:]
