"""The weight-only kernels (cuda/gemv_wo.cu, cuda/wo_dequant.cu) on the CPU, through the host
emulator (tests/helpers/cuda_emulator.py, tests/cuda/kernel_emulator.h): the kernel source
compiled as host C++ with its PTX helpers' host stand-ins, launched with the CudaBackend's
plans (llmc.cuda.gemv_wo_ops), against llmc.cuda.reference on random PackedWeights.

What the emulation checks without a GPU: the code unpacking (4-bit magic-exponent lop3 pairs
and 1/16-scaled odd pairs for f16, 8-bit prmt floats), the staged-activation pair order
against the mma fragment layouts, the three scale modes (row, kstep with per-k-step
activation sums for offsets, deq), f16 / f32 scales, scalar kernels, K tails (partial
k-steps), split-K warps and several rounds of tiles, every epilogue (bias, SiLU, residual
add, float32 logits). wo_rows_kernel (embedding, dequantize) is checked bit for bit against
PackedWeight.dequantize. Not marked ``cuda``: runs here; skipped where g++ is missing.
"""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_emulator import EmulatedFamily, emulator_missing
from helpers.packed_weights import random_packed
from llmc.cuda import reference as ref
from llmc.cuda.gemv_wo_ops import (
    WO_STAGES_SHIFT,
    wo_has_sums,
    wo_kernel_name,
    wo_ring_offset,
    wo_ring_stage_bytes,
    wo_row_stride,
    wo_scale_mode,
    wo_smem_bytes,
    wo_tiles,
)
from llmc.cuda.kernels import KernelConfig

pytestmark = [pytest.mark.skipif(emulator_missing(), reason="g++ not on PATH"), pytest.mark.slow]

EPS = 1e-5
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = {"norm": 0, "silu": 1, "add": 2, "linear": 3}

# (op, bits, group_size (None = K), offsets, scales, code_zero, M, K, N, SMs, note)
CASES = [
    ("norm", 4, 128, True, torch.float16, None, 1, 256, 40, 2, "kstep + sums, 3 tiles"),
    ("add", 4, 128, False, torch.float16, 8, 3, 384, 33, 1, "kstep symmetric"),
    ("silu", 4, 32, True, torch.float32, None, 2, 256, 24, 2, "deq, Q4_K-like"),
    ("linear", 4, 16, False, torch.float16, 8, 5, 160, 17, 1, "deq g16: two groups a vector"),
    ("norm", 8, None, False, torch.float16, 128, 8, 200, 19, 2, "row, scalar (K % 16 = 8)"),
    ("add", 8, 32, False, torch.float16, 128, 4, 512, 48, 3, "deq, Q8_0-like"),
    ("silu", 8, 16, False, torch.float32, 32, 1, 256, 16, 1, "deq, Q6_K-like"),
    ("linear", 8, 64, True, torch.float32, 0, 2, 192, 21, 2, "kstep + sums, K tail"),
    ("add", 4, None, True, torch.float16, 0, 7, 96, 9, 1, "row + sums, split-K, tail"),
    ("norm", 4, None, False, torch.float16, 8, 2, 100, 12, 1, "row, scalar (K / 2 = 50)"),
    ("norm", 4, 128, False, torch.float16, 8, 2, 128, 600, 1, "38 tiles: 3 rounds"),
    ("linear", 8, None, False, torch.float16, 128, 2, 1088, 256, 1, "row: 17 k-steps a warp"),
    ("silu", 4, None, True, torch.float32, 0, 3, 1152, 128, 1, "row + sums: 9 k-steps a warp"),
    ("norm", 4, 32, True, torch.float16, None, 6, 224, 20, 2, "deq, f16 G = 7: odd rows"),
    ("add", 8, 64, True, torch.float16, 0, 8, 320, 18, 1, "kstep + sums, f16 G = 5"),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    names = {
        wo_kernel_name(b, s, mode, v): 16
        for b in (4, 8)
        for s in ("row", "kstep", "deq")
        for mode in range(4)
        for v in (True, False)
    } | {
        wo_kernel_name(b, s, mode, True, ring=True): 16
        for b in (4, 8)
        for s in ("row", "kstep", "deq")
        for mode in range(4)
    }
    tmp = tmp_path_factory.mktemp("wo_emu")
    fams = {dt: EmulatedFamily("gemv_wo", KernelConfig(dt, 128, 32, 8), names, tmp) for dt in TORCH}
    rows = {
        dt: EmulatedFamily("wo_dequant", KernelConfig(dt, 128, 32, 8), {"wo_rows_kernel": 14}, tmp)
        for dt in ("float32", "bfloat16")
    }
    return fams, rows


def _case_id(c) -> str:
    return f"{c[0]}-int{c[1]}-g{c[2] or 'K'}-m{c[6]}-k{c[7]}-n{c[8]}"


def _inputs(case, dtype):
    op, bits, gs, offs, sdt, cz, m, k, n, _, _ = case
    dt, mode = TORCH[dtype], MODES[op]
    gs = gs or k
    rows = 2 * n if mode == 1 else n
    w = random_packed(rows, k, bits, gs, offsets=offs, scale_dtype=sdt, code_zero=cz, seed=k + n)
    g = torch.Generator().manual_seed(m * 7 + k)
    x = (3 * torch.randn(m, k, generator=g)).to(dt)
    norm_w = (1 + 0.3 * torch.randn(k, generator=g)).to(dt)
    bias = torch.randn(n, generator=g).to(dt) if mode in (0, 3) else None
    out_dt = torch.float32 if mode == 3 else dt
    out = torch.randn(m, n, generator=g).to(dt) if mode == 2 else torch.full((m, n), float("nan"))
    return w, x, norm_w, bias, out.to(out_dt)


def _launch(families, dtype, case, w, x, norm_w, bias, out, stages: int = 0) -> None:
    """One launch with the CudaBackend's plan (``stages`` > 0: the *_ring kernel)."""
    op, bits, _, offs, sdt, _, m, k, n, sms, _ = case
    mode, gs = MODES[op], w.group_size
    smode = wo_scale_mode(bits, k, gs)
    vector = w.codes.shape[1] % 16 == 0
    flags = (1 if sdt == torch.float32 else 0) | (2 if out.dtype == torch.float32 else 0) | 4
    flags |= stages << WO_STAGES_SHIFT
    kern = families[0][dtype][wo_kernel_name(bits, smode, mode, vector, ring=stages > 0)]
    grid = max(1, min(sms, wo_tiles(mode, n)))
    smem = wo_smem_bytes(bits, k, gs, m, offs)
    if stages:
        smem = wo_ring_offset(bits, k, gs, m, offs)
        smem += stages * wo_ring_stage_bytes(smode, bits, gs)
    assert smem <= 256 * 1024  # kernel_emulator.h's dynamic shared memory
    kern(
        (grid,), 512, x, norm_w if mode < 2 else 0, EPS, w.codes, w.scales,
        w.offsets if offs else 0, bias if bias is not None else 0, out, n, k, m,
        wo_row_stride(bits, k), gs, w.scales.shape[1], w.code_zero, flags,
    )  # fmt: skip


def _check(case, w, x, norm_w, bias, out, before) -> None:
    mode = MODES[case[0]]
    if mode == 0:
        want = ref.norm_linear(x, norm_w, EPS, w, bias)
    elif mode == 1:
        want = ref.norm_gate_up_silu(x, norm_w, EPS, w)
    elif mode == 2:
        want = ref.linear_residual_add(x, w, before.clone())
    else:
        want = ref.linear(x, w, bias).float()
    assert not torch.isnan(out).any(), "NaN: an output was never written"
    if mode == 2:  # the added part, not the residual, carries the error
        out, want = out.double() - before.double(), want.double() - before.double()
    err = ((out.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, f"{case[-1]}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", list(TORCH))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_emulated_gemv_wo_matches_reference(families, dtype, case):
    w, x, norm_w, bias, out = _inputs(case, dtype)
    before = out.clone()
    _launch(families, dtype, case, w, x, norm_w, bias, out)
    _check(case, w, x, norm_w, bias, out, before)


VECTOR_CASES = [c for c in CASES if (c[7] // (2 if c[1] == 4 else 1)) % 16 == 0]


@pytest.mark.parametrize("stages", [2, 5])
@pytest.mark.parametrize("dtype", list(TORCH))
@pytest.mark.parametrize("case", VECTOR_CASES, ids=_case_id)
def test_emulated_ring_is_the_register_kernel_bit_for_bit(families, dtype, case, stages):
    """The *_ring kernels (wo_ring.cuh) against the reference and, bit for bit, against the
    register-stream kernel: the same float32 operations in the same order (but for the row
    mode's sums (offsets, biased 8-bit codes) over more than one warp's columns: float
    atomics, order not fixed)."""
    w, x, norm_w, bias, out = _inputs(case, dtype)
    before = out.clone()
    reg = out.clone()
    _launch(families, dtype, case, w, x, norm_w, bias, reg)
    _launch(families, dtype, case, w, x, norm_w, bias, out, stages)
    _check(case, w, x, norm_w, bias, out, before)
    bits, gs, offs, k = case[1], case[2] or case[7], case[3], case[7]
    smode = wo_scale_mode(bits, k, gs)
    if not (wo_has_sums(bits, smode, offs) and smode == "row" and k // 8 > 32):
        assert torch.equal(out, reg), f"{case[-1]}: ring and register kernels differ"


LARGE_CASES = [  # 8-bit row / kstep codes stage f16 activations: values past its range
    ("linear", 8, None, False, torch.float16, 128, 3, 256, 24, 1, "row, |x| ~ 3e5"),
    ("add", 8, 64, True, torch.float16, 0, 2, 320, 18, 1, "kstep + sums, |x| ~ 3e5"),
    ("norm", 8, None, True, torch.float16, 128, 1, 512, 16, 2, "row + sums, norm_w ~ 1e5"),
]


@pytest.mark.parametrize("case", LARGE_CASES, ids=_case_id)
def test_emulated_gemv_wo8_stages_large_activations_scaled(families, case):
    """bf16 activations beyond f16's range (the f16 staging of the biased 8-bit codes): the
    prologue stages them times a power of two and the epilogue scales back: finite outputs
    within the reference's tolerance."""
    w, x, norm_w, bias, out = _inputs(case, "bfloat16")
    if case[0] == "norm":
        norm_w = (norm_w.float() * 1e5).to(torch.bfloat16)
    else:
        x = (x.float() * 1e5).to(torch.bfloat16)
    if out.dtype != torch.float32:
        out = (out.float() * 1e5).to(out.dtype)
    before = out.clone()
    _launch(families, "bfloat16", case, w, x, norm_w, bias, out)
    assert torch.isfinite(out).all(), f"{case[-1]}: an output overflowed"
    _check(case, w, x, norm_w, bias, out, before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "bits, gs, offs, sdt, k",
    [
        (4, 32, True, torch.float32, 256),  # Q4_K-like, vector path
        (8, 16, False, torch.float32, 64),  # Q6_K-like
        (8, 36, False, torch.float16, 72),  # gs % 8 != 0: scalar path
        (4, 14, True, torch.float16, 14),  # K % 8 != 0: scalar path
    ],
)
def test_emulated_rows_are_bit_exact(families, dtype, bits, gs, offs, sdt, k):
    w = random_packed(11, k, bits, gs, offsets=offs, scale_dtype=sdt, seed=k)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    kern = families[1][dtype]["wo_rows_kernel"]
    vec = int(k % 8 == 0 and gs % 8 == 0)
    per = 8 if vec else 1
    flags = 1 if sdt == torch.float32 else 0
    ids = torch.tensor([3, 0, 10, -1, 11, 3], dtype=torch.int64)  # -1, 11: zero rows
    out = torch.full((6, k), float("nan")).to(dt)
    grid = (-(-k // (per * 256)), 6)
    args = (w.codes, w.scales, w.offsets if offs else 0, out, 6, k, 11, bits, w.code_zero, gs)
    kern(grid, 256, ids, *args, w.scales.shape[1], flags, vec)
    dense = w.dequantize()
    want = torch.zeros(6, k)
    want[[0, 1, 2, 5]] = dense[[3, 0, 10, 3]]
    assert torch.equal(out, want.to(dt))
    full = torch.full((11, k), float("nan")).to(dt)  # dequantize: ids = nullptr
    args = (w.codes, w.scales, w.offsets if offs else 0, full, 11, k, 11, bits, w.code_zero, gs)
    kern((grid[0], 11), 256, 0, *args, w.scales.shape[1], flags, vec)
    assert torch.equal(full, dense.to(dt))
