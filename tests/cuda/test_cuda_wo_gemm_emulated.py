"""gemm_wo.cu (the weight-only linear of larger steps on tensor cores) on the CPU, through
the host emulator (tests/helpers/cuda_emulator.py: mma.sync / ldmatrix / cp.async emulated
per the PTX fragment layouts), launched with the CudaBackend's own plan
(llmc.cuda.gemm_wo_ops.gw_launch: tile, grid, shared memory, arguments).

What the emulation checks without a GPU: the cp.async staging of X and code rows (zero
fill past M, N and K), the dequantization into the W tile (4- and 8-bit codes, group sizes
16 .. K, offsets or none, f16 / f32 scales, code_zero), the row-scaled epilogue (one group
a row, no offsets), the ldmatrix / mma fragment addressing of every tile shape (32x64,
64x128, 128x128), the grouped CTA order (a partial group), partial k-tiles, the stage
ring's reuse of slots (more k-tiles than stages: the emulator's copies land at once, so a
slot overwritten too early shows), odd N, bias and both output dtypes. The kernel's
weights are the dequantize-then-cuBLAS weights (the formula rounded once into the
activation dtype), so the result must equal x @ w16.T rounded once up to accumulation
order (one rounding step of the output; row-scaled layouts, scaled in the epilogue: the
reference rounded once), and the reference linear within the GEMM tolerance. Not marked
``cuda``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import rel_err
from helpers.cuda_emulator import EmulatedFamily, emulator_missing
from helpers.packed_weights import random_packed
from llmc.cuda import reference as ref
from llmc.cuda.gemm_wo_ops import (
    GW_THREADS,
    GW_TILES,
    gw_kernel_name,
    gw_launch,
    gw_row_scaled,
)
from llmc.cuda.kernels import KernelConfig

pytestmark = [pytest.mark.skipif(emulator_missing(), reason="g++ not on PATH"), pytest.mark.slow]

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
F16, F32 = torch.float16, torch.float32

# (bits, group_size (None = K), offsets, scales, code_zero, M, K, N, SMs, bias, f32 out, note);
# "wraps": more k-tiles than cp.async stages, so slots are reused
CASES = [
    (4, 128, True, F16, None, 5, 640, 70, 1, True, False, "int4_wo g128, 32x64, ring wraps"),
    (8, None, False, F16, 128, 40, 448, 130, 1, True, True, "int8_wo row-scaled, 64x128, logits"),
    (4, None, False, F32, 8, 33, 256, 65, 1, False, False, "int4 gK sym row-scaled, f32 scales"),
    (4, None, True, F16, 0, 20, 192, 40, 1, True, False, "int4 gK asym: not row-scaled"),
    (8, 32, True, F32, 0, 129, 544, 20, 1, True, False, "Q5_K-like, 128x128, 8.5 k-tiles"),
    (4, 32, True, F32, 0, 130, 96, 33, 1, False, False, "Q4_K-like, 128x128, K tail"),
    (8, 16, False, F32, 32, 17, 160, 64, 1, False, False, "Q6_K-like g16, K tail"),
    (4, 64, False, F16, 8, 300, 64, 130, 10**4, True, False, "32x64 grid of 30: groups 8+2"),
    (8, 32, True, F16, 0, 9, 128, 7, 1, True, True, "Q8_0-like asym, N = 7"),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    names = {gw_kernel_name(b, *t): 13 for b in (4, 8) for t in GW_TILES}
    tmp = tmp_path_factory.mktemp("gemm_wo_emu")
    return {dt: EmulatedFamily("gemm_wo", KernelConfig(dt, 128, 32, 8), names, tmp) for dt in TORCH}


def _id(c) -> str:
    return f"int{c[0]}-g{c[1] or 'K'}-m{c[5]}-k{c[6]}-n{c[7]}"


@pytest.mark.parametrize("dtype", list(TORCH))
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_emulated_gemm_wo_matches_reference(families, dtype, case):
    bits, gs, offs, sdt, cz, m, k, n, sms, with_bias, f32_out, note = case
    dt = TORCH[dtype]
    w = random_packed(n, k, bits, gs or k, offsets=offs, scale_dtype=sdt, code_zero=cz, seed=k + n)
    g = torch.Generator().manual_seed(m * 7 + k)
    x = (3 * torch.randn(m, k, generator=g)).to(dt)
    bias = torch.randn(n, generator=g).to(dt) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=F32 if f32_out else dt)
    family, name, grid, smem, args = gw_launch(x, w, bias, out, sms)
    assert family == "gemm_wo"
    assert smem <= 256 * 1024  # the emulator's dynamic shared buffer
    families[dtype][name]((grid,), GW_THREADS, *(0 if a is None else a for a in args))
    assert not torch.isnan(out).any(), f"{note}: an output was never written"
    want = ref.linear(x, w, bias).float()
    assert rel_err(out.float(), want) < 1e-2, note
    # the same sum in another order: at most one rounding step of the output apart from
    # x @ w16.T (w16: the weights dequantize-then-cuBLAS uses), or from the reference where
    # the kernel scales rows in its epilogue (exact integer weights)
    w16 = w.dequantize().to(dt).float()
    same = (x.float() @ w16.T + (0 if bias is None else bias.float())).to(dt).float()
    torch.testing.assert_close(out.float(), want if gw_row_scaled(w) else same, rtol=2**-7,
                               atol=1e-3)  # fmt: skip
