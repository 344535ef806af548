"""cuda/gemv.cu's index math on the CPU: the kernel source compiled as host C++ (g++) over a
thread-per-CUDA-thread emulation (tests/gemv_emulator.h), checked against the torch
references on small shapes that exercise every path the GPU tests cover at scale: vector
kernels (16-bit: two-half shared-memory layout; float32), the *_scalar kernels, chunked
staging, CTAs looping over several units, N not a multiple of the rows per unit, bias.

The emulation replaces only the inline PTX (the streaming 16-byte load becomes a plain
load, the L2 prefetch a no-op) and the dtype conversions (round to nearest even), so a
wrong row, column, lane, chunk or shared-memory index shows here without a GPU. Skipped
where g++ is missing. Timing and the real PTX are the GPU tests' job (test_cuda_gemv.py).

cuda/gemv_fp8.cu the same way: its PTX (streamed loads, L2 prefetch, the e4m3 <-> f16 / f32
conversions, mma.sync m16n8k16) replaced by emulations written from the PTX ISA (fragment
layouts, saturating round-to-nearest-even e4m3), checked against llmc.cuda.reference_fp8 on
weights drawn from every finite e4m3 code, with activation rows at e4m3 rounding ties, a zero
row, K tails, split-K warps, several rounds of tiles and the scalar kernels.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmc.cuda import reference as ref
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.gemv_fp8_ops import gemv8_grid, gemv8_stride
from llmc.cuda.gemv_ops import gemv_grid
from llmc.cuda.kernels import CUDA_DIR

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": (0, torch.float32), "bfloat16": (2, torch.bfloat16)}
MODES = {"norm": 0, "silu": 1, "add": 2}
EPS = 1e-5


def host_common() -> str:
    """common.cuh as host C++: the PTX dtype conversions replaced."""
    common = (CUDA_DIR / "common.cuh").read_text().replace("#pragma once\n", "")
    a = common.index("#if LLMC_DTYPE == 0\ntypedef float scalar_t;")
    b = common.index("// Elements of scalar_t in one 16-byte vector.")
    return common[:a] + _HOST_DTYPES + common[b:]


def host_source(dtype_code: int) -> str:
    """gemv.cu + common.cuh as host C++: PTX and dtype conversions replaced."""
    common = host_common()
    gemv = (CUDA_DIR / "gemv.cu").read_text().replace('#include "common.cuh"', "")
    gemv, n_ld = re.subn(
        r'asm\("ld\.global\.nc.*?\);', "r = *reinterpret_cast<const v4u*>(p);", gemv, flags=re.S
    )
    gemv, n_pf = re.subn(r'asm volatile\("prefetch.*?\);', "(void)p;", gemv, flags=re.S)
    gemv, n_bar = re.subn(
        r'asm volatile\("bar\.sync.*?\);', "emu_named_barrier(id);", gemv, flags=re.S
    )
    gemv = gemv.replace("extern __shared__ v4f gemv_smem[];", "v4f* gemv_smem = (v4f*)emu_smem;")
    assert n_ld == 1 and n_pf == 1 and n_bar == 1 and "asm" not in gemv and "asm" not in common
    return (
        f'#define LLMC_DTYPE {dtype_code}\n#include "gemv_emulator.h"\n{common}\n{gemv}\n'
        '#define GEMV_EMULATOR_MAIN\n#include "gemv_emulator.h"\n'
    )


_HOST_DTYPES = """#if LLMC_DTYPE == 0
typedef float scalar_t;
inline float to_float(float x) { return x; }
inline float from_float(float x) { return x; }
#else
typedef unsigned short scalar_t;
inline float to_float(unsigned short x) {
#if LLMC_DTYPE == 1
    return emu_half_to_float(x);
#else
    return __uint_as_float(((unsigned int)x) << 16);
#endif
}
inline unsigned short from_float(float f) {
#if LLMC_DTYPE == 1
    return emu_float_to_half(f);
#else
    return emu_float_to_bf16(f);
#endif
}
inline unsigned int pack2(float lo, float hi) {
    return (unsigned int)from_float(lo) | ((unsigned int)from_float(hi) << 16);
}
#endif
"""


def compile_emulators(tmp: Path, source: Callable[[int], str]) -> dict[str, Path]:
    """One emulator binary per dtype from ``source(dtype code)``, compiled in parallel."""
    procs = {}
    for name, (code, _) in DTYPES.items():
        cpp = tmp / f"{name}.cpp"
        cpp.write_text(source(code))
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-w", f"-I{HERE}", f"-I{CUDA_DIR}"]
        cmd += ["-o", str(tmp / name)]  # CUDA_DIR: the kernels' own headers (gemv_skeleton.cuh)
        procs[name] = subprocess.Popen(
            [*cmd, str(cpp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for name, p in procs.items():
        out, _ = p.communicate()
        assert p.returncode == 0, f"g++ failed for {name}:\n{out}"
    return {name: tmp / name for name in DTYPES}


@pytest.fixture(scope="module")
def emulators(tmp_path_factory) -> dict[str, Path]:
    return compile_emulators(tmp_path_factory.mktemp("gemv_emu"), host_source)


def run_emulated(
    binary: Path, tmp: Path, op: str, dtype: torch.dtype, m: int, k: int, n: int, kc: int,
    grid: int, vec: bool, bias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kernel output, reference) for one launch on random inputs."""
    g = torch.Generator().manual_seed(m * 131 + k + n)
    mode = MODES[op]
    rows = 2 * n if mode == 1 else n
    x = (3 * torch.randn(m, k, generator=g)).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(rows, k, generator=g) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    if mode == 2:
        init = torch.randn(m, n, generator=g).to(dtype)
    else:
        init = torch.full((m, n), float("nan"), dtype=dtype)
    grid = gemv_grid(m, mode, n, sm_count=grid)
    blob = b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes() for t in (x, norm_w, w, b, init)
    )
    inp, outp = tmp / "in.bin", tmp / "out.bin"
    inp.write_bytes(blob)
    args = [mode, m, n, k, kc, grid, int(vec), int(bias), EPS, inp, outp]
    subprocess.run([str(binary), *map(str, args)], check=True, timeout=120)
    out = torch.frombuffer(bytearray(outp.read_bytes()), dtype=dtype).view(m, n)
    if mode == 0:
        want = ref.norm_linear(x, norm_w, EPS, w, b if bias else None)
    elif mode == 1:
        want = ref.norm_gate_up_silu(x, norm_w, EPS, w)
    else:
        want = ref.linear_residual_add(x, w, init.clone())
    return out, want


# (op, M, K, N, KC, SMs, vector kernels): K % 8 == 0 unless scalar
CASES = [
    ("norm", 1, 1000, 77, 1000, 2, True),  # one chunk; 2 CTAs x 16 warps, 77 units: 3 rounds
    ("norm", 3, 1000, 77, 256, 3, True),  # chunks 256 x 3 + 232
    ("norm", 8, 1000, 77, 256, 1, True),  # R = 4: 20 units (last one partial) on one CTA
    ("silu", 1, 1000, 37, 1000, 1, True),
    ("silu", 5, 1000, 37, 256, 2, True),  # R = 4: two outputs (gate, up pairs) per warp
    ("silu", 8, 1000, 37, 1000, 3, True),
    ("add", 2, 1000, 77, 1000, 3, True),
    ("add", 4, 1000, 77, 256, 2, True),
    ("add", 8, 1000, 77, 1000, 2, True),
    ("norm", 8, 999, 21, 512, 2, False),  # scalar kernels, chunked, K odd
    ("silu", 3, 999, 21, 999, 1, False),
    ("add", 6, 512, 40, 512, 1, False),  # scalar kernels on an aligned shape
    ("add", 1, 64, 5, 64, 4, True),  # fewer units than warps: 4 CTAs, 5 units
    # few units: two warps per unit (each over half of every chunk), with and without chunks
    ("add", 5, 1000, 37, 256, 8, True),
    ("norm", 2, 1000, 30, 1000, 4, True),
    ("silu", 8, 1000, 9, 1000, 8, True),
    ("norm", 3, 999, 10, 256, 8, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-m{c[1]}-k{c[2]}-kc{c[4]}")
def test_emulated_kernel_matches_reference(emulators, tmp_path, dtype, case):
    op, m, k, n, kc, grid, vec = case
    torch_dtype = DTYPES[dtype][1]
    tol = 1e-5 if torch_dtype == torch.float32 else 1e-2
    for bias in (False, True) if op == "norm" else (False,):
        out, want = run_emulated(
            emulators[dtype], tmp_path, op, torch_dtype, m, k, n, kc, grid, vec, bias
        )
        assert not torch.isnan(out).any(), "NaN: an output was never written"
        err = ((out.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, f"{op} M={m} K={k} N={n} KC={kc} bias={bias}: rel err {err:.2e}"


# ---- cuda/gemv_fp8.cu -------------------------------------------------------------------

_PTX8 = (  # (pattern, host C++, count): every asm statement of gemv_fp8.cu
    (r'asm volatile\("ld\.global\.nc.*?\);', "r = *reinterpret_cast<const v4u*>(p);", 1),
    (r'asm volatile\("prefetch.*?\);', "(void)p;", 1),
    (r'asm\("cvt\.rn\.f16x2\.e4m3x2.*?\);', "r = emu_e4m3x2_to_f16x2(v);", 1),
    (r'asm\("cvt\.rn\.satfinite\.e4m3x2\.f32.*?\);', "r = emu_f32x2_to_e4m3x2(lo, hi);", 1),
    (r'asm\("mma\.sync.*?\);', "emu_mma_f16(d, a, b);", 1),
)


def host_source8(dtype_code: int) -> str:
    """gemv_fp8.cu + common.cuh as host C++: PTX and dtype conversions replaced."""
    src = (CUDA_DIR / "gemv_fp8.cu").read_text().replace('#include "common.cuh"', "")
    for pattern, repl, count in _PTX8:
        src, n = re.subn(pattern, repl, src, flags=re.S)
        assert n == count, pattern
    src = src.replace("extern __shared__ v4u g8_smem[];", "v4u* g8_smem = (v4u*)emu_smem;")
    assert "asm" not in src
    return (
        f'#define LLMC_DTYPE {dtype_code}\n#include "gemv_emulator.h"\n{host_common()}\n{src}\n'
        '#define GEMV8_EMULATOR_MAIN\n#include "gemv_emulator.h"\n'
    )


@pytest.fixture(scope="module")
def emulators8(tmp_path_factory) -> dict[str, Path]:
    return compile_emulators(tmp_path_factory.mktemp("gemv8_emu"), host_source8)


def random_codes(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[rows, K] e4m3 weights drawn uniformly from the 254 finite codes (every subnormal,
    ±0, ±448), so every conversion path sees every value."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    idx = torch.randint(0, len(finite), (rows, k), generator=g)
    return finite[idx].view(ref8.FP8_DTYPE)


def tie_rows(m: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Activation rows whose quantization hits e4m3 rounding ties: row 0 with amax 448
    (inv = 1) full of midpoints between codes (normal, subnormal, next to 448), row 1 all
    zeros (the amax floor), row 2 the same ties at amax 896, the rest random."""
    ties = torch.tensor([1.0625, -1.1875, 2.0**-10, -3 * 2.0**-10, 5 * 2.0**-10, 13.0, 416.0])
    x = 3 * torch.randn(m, k, generator=g)
    row = ties[torch.randint(0, len(ties), (k,), generator=g)]
    row[: k // 2] = 0.01 * torch.randn(k // 2, generator=g)
    row[0], row[1] = 448.0, -440.0
    x[0] = row
    if m > 1:
        x[1] = 0.0
    if m > 2:
        x[2] = 2 * row
    return x.to(dtype)


def run_emulated8(
    binary: Path, tmp: Path, op: str, dtype: torch.dtype, m: int, k: int, n: int, grid: int,
    vec: bool, bias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kernel output, reference_fp8) for one gemv_fp8.cu launch on random inputs."""
    g = torch.Generator().manual_seed(m * 131 + k + n)
    mode = MODES[op]
    rows = 2 * n if mode == 1 else n
    x = tie_rows(m, k, dtype, g) if mode == 2 else (3 * torch.randn(m, k, generator=g)).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    w8 = random_codes(rows, k, g)
    ws = (1e-3 + 1e-2 * torch.rand(rows, generator=g)).float()
    b = torch.randn(n, generator=g).to(dtype)
    if mode == 2:
        init = torch.randn(m, n, generator=g).to(dtype)
    else:
        init = torch.full((m, n), float("nan"), dtype=dtype)
    grid = gemv8_grid(mode, n, sm_count=grid)
    parts = [
        t.contiguous().view(torch.uint8).numpy().tobytes() for t in (ws, x, norm_w, b, init, w8)
    ]
    blob = b"".join(p + bytes(-len(p) % 16) for p in parts)
    inp, outp = tmp / "in.bin", tmp / "out.bin"
    inp.write_bytes(blob)
    args = [mode, m, n, k, gemv8_stride(k), grid, int(vec), int(bias), EPS, inp, outp]
    subprocess.run([str(binary), *map(str, args)], check=True, timeout=300)
    out = torch.frombuffer(bytearray(outp.read_bytes()), dtype=dtype).view(m, n)
    if mode == 0:
        want = ref8.norm_linear_fp8(x, norm_w, EPS, w8, ws, b if bias else None)
    elif mode == 1:
        want = ref8.norm_gate_up_silu_fp8(x, norm_w, EPS, w8, ws)
    else:
        want = ref8.linear_residual_add_fp8(x, w8, ws, init.clone())
    return out, want


# (op, M, K, N, SMs, vector kernels): vector kernels need K % 16 == 0
CASES8 = [
    ("norm", 1, 1024, 77, 2, True),  # 5 tiles on 2 CTAs: 5 and 8 warps per tile
    ("norm", 3, 1008, 40, 1, True),  # K % 64 = 48: the last k-step is partial
    ("norm", 8, 1000, 21, 2, False),  # scalar kernels (K % 16 = 8)
    ("norm", 6, 256, 600, 2, True),  # 19 tiles per CTA: a round of 16 (1 warp each), then 3
    ("norm", 4, 576, 960, 3, True),  # SmolLM2 qkv: 20 tiles per CTA
    ("silu", 1, 1024, 37, 1, True),  # 5 tiles of 8 gate | 8 up rows, 3 warps each
    ("silu", 5, 576, 200, 2, True),  # 13 / 12 tiles per CTA: one warp per tile
    ("silu", 8, 999, 21, 1, False),
    ("silu", 2, 512, 9, 8, True),  # 2 tiles, 16 warps each over 8 k-steps (most idle)
    ("add", 2, 1536, 64, 3, True),
    ("add", 4, 128, 330, 1, True),  # 21 tiles on one CTA: rounds of 16 and 5
    ("add", 7, 1024, 77, 1, True),
    ("add", 8, 1024, 48, 2, True),
    ("add", 1, 64, 5, 4, True),  # one tile, one k-step
    ("add", 5, 520, 33, 2, False),
    # M = 1 at long K: 3 and 4 vectors a thread in the prologue's passes, partial k-steps
    ("norm", 1, 8208, 9, 2, True),
    ("add", 1, 1008, 40, 1, True),
    ("add", 1, 16384, 6, 2, True),
    ("silu", 1, 16400, 5, 1, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES8, ids=lambda c: f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}")
def test_emulated_fp8_kernel_matches_reference(emulators8, tmp_path, dtype, case):
    op, m, k, n, grid, vec = case
    torch_dtype = DTYPES[dtype][1]
    tol = 1e-5 if torch_dtype == torch.float32 else 1e-2
    for bias in (False, True) if op == "norm" else (False,):
        out, want = run_emulated8(
            emulators8[dtype], tmp_path, op, torch_dtype, m, k, n, grid, vec, bias
        )
        assert not torch.isnan(out).any(), "NaN: an output was never written"
        err = ((out.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, f"{op} M={m} K={k} N={n} bias={bias}: rel err {err:.2e}"
