"""The CudaBackend's weight-only launches on the CPU, recorded instead of run
(tests/helpers/gemv_launch.py): the dispatch on the weight's type, the kernel chosen per
layout (scale mode from the group size, vector or *_scalar), the arguments against the C
signature of cuda/gemv_wo.cu / wo_dequant.cu, grid and shared memory, the fallbacks
(dequantize-then-cuBLAS past the staging budget, for float32, for T > 8, for group sizes
that are no multiple of 16), and which engines compile the quantized families."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from helpers.gemv_launch import NP_TYPE, aligned, recording_backend
from helpers.packed_weights import random_packed
from llmc.base.errors import UnsupportedError
from llmc.cuda import gemv_wo_ops as wo
from llmc.cuda import wo_dequant_ops as wod
from llmc.cuda.build import families_for
from llmc.cuda.gemv_ops import GEMV_THREADS
from llmc.cuda.kernels import CUDA_DIR, FAMILIES, WO_QUANTIZATIONS, KernelConfig


def _signature(file: str, pattern: str) -> list[str]:
    text = (CUDA_DIR / file).read_text().replace("\\\n", " ")
    params = re.search(pattern, text, re.S).group(1)
    return [p.strip().rsplit(" ", 1)[0] for p in params.split(",")]


GEMV_SIG = _signature("gemv_wo.cu", r"\) NAME\((.*?)\) \{")
ROWS_SIG = _signature("wo_dequant.cu", r"void wo_rows_kernel\((.*?)\) \{")


def check(launch: tuple, types: list[str]) -> tuple:
    kern, grid, block, args, smem = launch
    assert len(args) == len(types), (kern.name, len(args), types)
    for a, ty in zip(args, types, strict=True):
        want = np.uint64 if "*" in ty else {"long long": np.int64, **NP_TYPE}[ty]
        assert type(a) is want, (kern.name, ty, type(a))
    return kern, grid, block, args, smem


@pytest.fixture
def be(monkeypatch):
    monkeypatch.setattr(wo, "_need", lambda t, name, dtype=None: None)
    return recording_backend(monkeypatch)


@pytest.fixture
def ring(be):
    """``be`` with the ring kernels on (the register kernels are the default: WoOps)."""
    assert be.wo_stages == 0
    be.wo_stages = 8
    return be


def test_signatures_parsed():
    assert len(GEMV_SIG) == 16 and GEMV_SIG[2] == "float" and GEMV_SIG[-1] == "int"
    assert len(ROWS_SIG) == 14 and ROWS_SIG[7] == "long long"


@pytest.mark.parametrize(
    "bits, gs, k, mode",
    [(4, 128, 4096, "kstep"), (4, 256, 4096, "kstep"), (4, 4096, 4096, "row"),
     (8, 64, 4096, "kstep"), (8, 14336, 14336, "row"), (4, 32, 4096, "deq"),
     (4, 16, 4096, "deq"), (8, 32, 4096, "deq"), (4, 48, 4800, "deq"), (4, 8, 4096, None),
     (8, 24, 4800, None)],
)  # fmt: skip
def test_scale_modes(bits, gs, k, mode):
    assert wo.wo_scale_mode(bits, k, gs) == mode


@pytest.mark.parametrize("m", [1, 4, 8])
def test_fused_launches_match_the_signature(be, m):
    be.wo_stages = 0  # the register-stream kernels (the ring's launches: test_ring_launches)
    k, n, i = 4096, 600, 704  # 38 tiles: 38 CTAs
    x, nw = aligned(m, k), aligned(k)
    w = random_packed(n, k, 4, 128, offsets=True)
    be.norm_linear(x, nw, 1e-5, w, aligned(n), out=aligned(m, n))
    kern, grid, block, args, smem = check(be.launches[-1], GEMV_SIG)
    assert kern.family == "gemv_wo" and kern.name == "gemv_wo4_kstep_norm"
    assert block == (GEMV_THREADS,) and grid == (38,)
    assert args[8:] == (n, k, m, 32 * 256 + 64, 128, 32, 0, 4)  # N K M S gs G code_zero flags
    assert smem == m * (32 * 256 + 64) + m * 32 * 4  # staged rows + per-k-step sums
    assert kern.max_dynamic_shared_size_bytes == be._gemv_smem - wo.WO_SMEM_MARGIN
    gu = random_packed(2 * i, k, 4, 32, offsets=True, scale_dtype=torch.float32)
    be.norm_gate_up_silu(x, nw, 1e-5, gu, out=aligned(m, i))
    kern, grid, _, args, smem = check(be.launches[-1], GEMV_SIG)
    assert kern.name == "gemv_wo4_deq_norm_silu" and args[8] == i and args[-1] == 1 | 4
    assert smem == m * (32 * 256 + 64)  # deq: the offsets are in the weights, no sums
    down = random_packed(k, i, 8, i, offsets=False, code_zero=128)
    res = aligned(m, k)
    assert be.linear_residual_add(aligned(m, i), down, res) is res
    kern, grid, _, args, smem = check(be.launches[-1], GEMV_SIG)
    assert kern.name == "gemv_wo8_row_add" and args[-2] == 128 and grid == (132,)
    assert args[-1] == 0  # no L2 prefetch for the biased 8-bit codes (wo_prefetches)
    assert smem == m * (11 * 128 + 64) + m * 4  # 704 columns: 11 k-steps of 64; row sums
    small = random_packed(40, 256, 8, 16, offsets=False, scale_dtype=torch.float32, code_zero=32)
    logits = aligned(m, 40, dtype=torch.float32)
    be.linear(aligned(m, 256), small, out=logits)
    kern, grid, _, args, _ = check(be.launches[-1], GEMV_SIG)
    assert kern.name == "gemv_wo8_deq_linear" and grid == (3,) and args[-1] == 1 | 2 | 4
    be.wo_prefetch = False
    be.linear(aligned(m, 256), small, out=logits)
    assert be.launches[-1][3][-1] == 1 | 2


@pytest.mark.parametrize("m, stages", [(1, 7), (4, 6), (8, 5)])
def test_ring_launches(ring, m, stages):
    """The *_ring kernels with wo_stages > 0: as many stages (<= wo_stages) as the budget
    holds after the staging and the sums (kstep: 24 KB a stage), the count in flags >> 8."""
    be = ring
    k, n = 4096, 600
    w = random_packed(n, k, 4, 128, offsets=True)
    be.norm_linear(aligned(m, k), aligned(k), 1e-5, w, out=aligned(m, n))
    kern, grid, _, args, smem = check(be.launches[-1], GEMV_SIG)
    assert kern.name == "gemv_wo4_kstep_norm_ring" and grid == (38,)
    base = m * (32 * 256 + 64) + m * 32 * 4  # staged rows + sums, 16-byte aligned already
    budget = be._gemv_smem - wo.WO_SMEM_MARGIN
    assert (budget - base) // (16 * 3 * 512) == stages and args[-1] == 4 | stages << 8
    assert smem == base + stages * 16 * 3 * 512 <= budget
    be.wo_stages = 3  # the knob caps the count
    be.norm_linear(aligned(m, k), aligned(k), 1e-5, w, out=aligned(m, n))
    assert be.launches[-1][3][-1] >> 8 == 3
    be.wo_stages = 0
    be.norm_linear(aligned(m, k), aligned(k), 1e-5, w, out=aligned(m, n))
    assert be.launches[-1][0].name == "gemv_wo4_kstep_norm"


@pytest.mark.parametrize(
    "bits, gs, chunks", [(4, 32, 3), (4, 64, 3), (4, 16, 4), (4, 48, 4), (8, 16, 3), (8, 32, 3)]
)
def test_ring_stage_of_the_deq_mode(ring, bits, gs, chunks):
    """deq stages carry one scale chunk where each lane's code vector lies in one group (4-bit
    gs % 32 == 0, 8-bit always), two where it spans two (4-bit g16, g48)."""
    be = ring
    k, n = 3072, 64  # every gs divides it
    w = random_packed(n, k, bits, gs, offsets=True, scale_dtype=torch.float32)
    be.linear(aligned(1, k), w, out=aligned(1, n))
    kern, _, _, args, smem = check(be.launches[-1], GEMV_SIG)
    assert kern.name == f"gemv_wo{bits}_deq_linear_ring"
    assert wo.wo_ring_stage_bytes("deq", bits, gs) == 16 * 512 * chunks
    stages = args[-1] >> 8
    base = wo.wo_row_stride(bits, k)  # M = 1, no sums in the deq mode
    assert stages == min(8, (be._gemv_smem - wo.WO_SMEM_MARGIN - base) // (16 * 512 * chunks))
    assert smem == base + stages * 16 * 512 * chunks


def test_ring_falls_back_to_the_register_kernels(ring):
    """Fewer than 2 stages fit (down at M = 6: 6 x 28736 staged bytes), or scales / offsets
    not 4-byte aligned (wo_ring.cuh copies 32-bit words): the register-stream kernel."""
    be = ring
    k, n = 14336, 64
    w = random_packed(n, k, 4, 128, offsets=True)
    be.linear_residual_add(aligned(4, k), w, aligned(4, n))
    assert be.launches[-1][0].name == "gemv_wo4_kstep_add_ring"  # 4 x 28736: 3 stages fit
    assert be.launches[-1][3][-1] >> 8 == 3
    be.linear_residual_add(aligned(6, k), w, aligned(6, n))
    assert be.launches[-1][0].name == "gemv_wo4_kstep_add"
    assert be.launches[-1][3][-1] >> 8 == 0
    w = random_packed(n, 256, 8, 32, offsets=False)  # deq, f16 scales
    x = aligned(2, 256)
    be.linear(x, w, out=aligned(2, n))
    assert be.launches[-1][0].name == "gemv_wo8_deq_linear_ring"
    odd = aligned(n * 8 + 1, dtype=torch.float16)[1:].view(n, 8)  # base 2 mod 4
    odd.copy_(w.scales)
    w2 = type(w)(w.codes, odd, None, 8, w.code_zero, 32)
    be.linear(x, w2, out=aligned(2, n))
    assert be.launches[-1][0].name == "gemv_wo8_deq_linear"


def test_scalar_kernels(be):
    w = random_packed(21, 100, 4, 100, offsets=False)  # 50-byte code rows
    be.linear(aligned(2, 100), w, out=aligned(2, 21))
    assert be.launches[-1][0].name == "gemv_wo4_row_linear_scalar"
    w = random_packed(21, 512, 4, 128, offsets=False)
    x = aligned(2 * 512 + 1)[1:].view(2, 512)  # misaligned base
    be.linear_residual_add(x, w, aligned(2, 21))
    assert be.launches[-1][0].name == "gemv_wo4_kstep_add_scalar"


def test_fused_op_in_two_passes_past_the_staging_budget(be):
    """down_proj at M = 8 (K = 14,336: 8 staged rows need 229 KB, more than the budget):
    two launches of the fused kernel on row slices of x and the residual (as many rows as
    fit, then the rest), no dequantized weight."""
    k, n = 14336, 64
    w = random_packed(n, k, 4, 128, offsets=True)
    budget = be._gemv_smem - wo.WO_SMEM_MARGIN
    fit = max(r for r in range(1, 9) if wo.wo_smem_bytes(4, k, 128, r, True) <= budget)
    assert 4 <= fit < 8
    x, res = aligned(8, k), aligned(8, n)
    be.linear_residual_add(x, w, res)
    assert [lk[0].name for lk in be.launches] == ["gemv_wo4_kstep_add"] * 2
    assert [int(lk[3][10]) for lk in be.launches] == [fit, 8 - fit]  # M
    assert [int(lk[3][0]) - x.data_ptr() for lk in be.launches] == [0, fit * k * 2]
    assert [int(lk[3][7]) - res.data_ptr() for lk in be.launches] == [0, fit * n * 2]


def test_fallbacks_dequantize_then_mm(be):
    """Past the staging budget in the passes 8-bit codes take (down of a 70B shape at M = 8:
    K = 28,672, 3 rows a launch, 2 launches at most), float32 activations, more rows than the
    gemv passes take (int4: 32, int8: 16), a group size no kernel serves: wo_rows_kernel
    into a temporary, then torch.mm."""
    k, n = 28672, 64
    w = random_packed(n, k, 8, k, offsets=False, code_zero=128)
    budget = be._gemv_smem - wo.WO_SMEM_MARGIN
    assert wo.wo_smem_bytes(8, k, k, 4, False) > budget >= wo.wo_smem_bytes(8, k, k, 3, False)
    x = torch.zeros(8, k, dtype=torch.bfloat16)
    res = torch.zeros(8, n, dtype=torch.bfloat16)
    be.linear_residual_add(x, w, res)
    kern, grid, block, args, _ = check(be.launches[-1], ROWS_SIG)
    assert kern.family == "wo_dequant" and args[5:8] == (n, k, n) and grid == (14, n)
    assert block == (wod.WO_ROWS_THREADS,) and args[-1] == 1  # vector path
    for xx, ww in (
        (torch.zeros(2, 256), random_packed(n, 256, 8, 256, offsets=False)),  # float32
        (torch.zeros(33, 256, dtype=torch.bfloat16), random_packed(n, 256, 4, 128, offsets=True)),
        (torch.zeros(17, 256, dtype=torch.bfloat16), random_packed(n, 256, 8, 256, offsets=False)),
        (torch.zeros(2, 256, dtype=torch.bfloat16), random_packed(n, 256, 4, 8, offsets=True)),
    ):
        before = len(be.launches)
        out = be.linear(xx, ww)
        assert out.shape == (xx.shape[0], n) and out.dtype == xx.dtype
        assert [lk[0].family for lk in be.launches[before:]] == ["wo_dequant"]


def test_linear_chunks_large_weights(be, monkeypatch):
    monkeypatch.setattr(wod, "WO_CHUNK_BYTES", 64 * 256 * 2)  # 64 rows of K 256 per chunk
    monkeypatch.setattr(wod, "WO_CHUNK_ALIGN", 32)  # 3 chunks of 50 -> 64 rows
    w = random_packed(150, 256, 4, 128, offsets=True)
    out = be.linear(
        torch.zeros(40, 256, dtype=torch.bfloat16), w, torch.zeros(150, dtype=torch.bfloat16)
    )
    rows = [lk for lk in be.launches if lk[0].family == "wo_dequant"]
    assert [lk[3][5] for lk in rows] == [64, 64, 22] and out.shape == (40, 150)
    assert [int(lk[3][1]) - int(rows[0][3][1]) for lk in rows] == [0, 64 * 128, 128 * 128]


@pytest.mark.parametrize(
    "bits, gs, offs, sdt, k",
    [(4, 128, True, torch.float16, 512), (8, 512, False, torch.float16, 512),
     (4, 32, True, torch.float32, 256), (8, 36, False, torch.float16, 72),
     (4, 8, True, torch.float16, 72)],  # 36-byte code rows: row 3 starts 4 bytes off 8
)  # fmt: skip
def test_dequantize_chunks_launch_as_the_row_kernel(be, bits, gs, offs, sdt, k):
    """linear's chunk launches (``_wo_dequant_rows``, per-weight arguments built once) are
    exactly ``_wo_rows``'s (the embedding's gather) for every chunk start, aligned or not,
    vector and scalar paths; a second weight gets its own arguments."""
    w = random_packed(200, k, bits, gs, offsets=offs, scale_dtype=sdt)
    unaligned = torch.empty(5 * k + 1, dtype=torch.bfloat16)[1:].view(5, k)
    chunks = [(0, 64, aligned(64, k)), (64, 64, aligned(64, k)), (128, 72, aligned(72, k))]
    for n0, t, out in [*chunks, (3, 5, aligned(5, k)), (3, 5, unaligned)]:
        be.launches.clear()
        be._wo_rows(w, None, n0, t, out)
        be._wo_dequant_rows(w, n0, t, out)
        (k1, g1, b1, a1, s1), (k2, g2, b2, a2, s2) = be.launches
        check(be.launches[1], ROWS_SIG)
        assert (k1.name, g1, b1, s1) == (k2.name, g2, b2, s2)
        assert [(type(a), a) for a in a1] == [(type(a), a) for a in a2], (n0, t)
    assert len(be._wo_consts) == 1
    w2 = random_packed(200, k, bits, gs, offsets=offs, scale_dtype=sdt, seed=1)
    be.launches.clear()
    be._wo_dequant_rows(w2, 0, 8, aligned(8, k))
    assert int(be.launches[0][3][1]) == w2.codes.data_ptr() and len(be._wo_consts) == 2


def test_linear_gemv_passes_of_eight_rows(ring):
    """T = 20 rows of an int4 weight: three passes of the gemv kernel (8, 8, 4 rows) on row
    slices of x and out, no dequantized weight."""
    be = ring
    w = random_packed(64, 256, 4, 128, offsets=True)
    x, out = aligned(20, 256), aligned(20, 64)
    be.linear(x, w, out=out)
    assert [lk[0].name for lk in be.launches] == ["gemv_wo4_kstep_linear_ring"] * 3
    assert [int(lk[3][10]) for lk in be.launches] == [8, 8, 4]  # M
    assert [int(lk[3][0]) - x.data_ptr() for lk in be.launches] == [0, 8 * 512, 16 * 512]
    assert [int(lk[3][7]) - out.data_ptr() for lk in be.launches] == [0, 8 * 128, 16 * 128]


def test_embedding_launch(be):
    table = random_packed(1000, 576, 4, 32, offsets=True, scale_dtype=torch.float32)
    out = aligned(5, 576)
    assert be.embedding(torch.zeros(5, dtype=torch.int64), table, out=out) is out
    kern, grid, _, args, _ = check(be.launches[-1], ROWS_SIG)
    assert kern.name == "wo_rows_kernel" and grid == (1, 5) and args[5:8] == (5, 576, 1000)
    assert args[-2:] == (1, 1)  # f32 scales, vector


def test_bad_inputs(be):
    w = random_packed(64, 256, 4, 128, offsets=True)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.norm_linear(aligned(9, 256), aligned(256), 1e-5, w)
    with pytest.raises(UnsupportedError, match="do not chain"):
        be.linear_residual_add(aligned(2, 128), w, aligned(2, 64))
    with pytest.raises(UnsupportedError, match="norm weight has shape"):
        be.norm_linear(aligned(2, 256), aligned(255), 1e-5, w)
    with pytest.raises(UnsupportedError, match="out .* expected"):
        be.linear(aligned(2, 256), w, out=aligned(2, 63))


def test_quantized_families_compile_only_where_needed():
    every = set(families_for(KernelConfig("bfloat16", 128, 32, 8)))
    assert every == set(FAMILIES)
    quant = {"gemv_fp8", "gemv_wo", "wo_dequant"}
    wo_fams = {"gemv_wo", "wo_dequant"}
    cases = [("none", set()), ("fp8", {"gemv_fp8"})] + [(q, wo_fams) for q in WO_QUANTIZATIONS]
    for q, has in cases:
        fams = set(families_for(KernelConfig("bfloat16", 128, 32, 8, q), "sm_90"))
        assert fams & quant == has, q
    f32 = set(families_for(KernelConfig("float32", 64, 9, 3, "gguf")))
    assert "wo_dequant" in f32 and "gemv_wo" not in f32  # float32: dequantize-then-matmul
