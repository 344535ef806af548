"""cuda/gemv.cu's index math on the CPU: the kernel source compiled as host C++ (g++) over a
thread-per-CUDA-thread emulation (tests/gemv_emulator.h), checked against the torch
references on small shapes that exercise every path the GPU tests cover at scale: vector
kernels (16-bit: two-half shared-memory layout; float32), the *_scalar kernels, chunked
staging, CTAs looping over several units, N not a multiple of the rows per unit, bias.

The emulation replaces only the inline PTX (the streaming 16-byte load becomes a plain
load, the L2 prefetch a no-op) and the dtype conversions (round to nearest even), so a
wrong row, column, lane, chunk or shared-memory index shows here without a GPU. Skipped
where g++ is missing. Timing and the real PTX are the GPU tests' job (test_cuda_gemv.py).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from llmc.cuda import reference as ref
from llmc.cuda.gemv_ops import gemv_grid
from llmc.cuda.kernels import CUDA_DIR

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": (0, torch.float32), "bfloat16": (2, torch.bfloat16)}
MODES = {"norm": 0, "silu": 1, "add": 2}
EPS = 1e-5


def host_source(dtype_code: int) -> str:
    """gemv.cu + common.cuh as host C++: PTX and dtype conversions replaced."""
    common = (CUDA_DIR / "common.cuh").read_text().replace("#pragma once\n", "")
    a = common.index("#if LLMC_DTYPE == 0\ntypedef float scalar_t;")
    b = common.index("// Elements of scalar_t in one 16-byte vector.")
    common = common[:a] + _HOST_DTYPES + common[b:]
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


@pytest.fixture(scope="module")
def emulators(tmp_path_factory) -> dict[str, Path]:
    """One emulator binary per dtype, compiled in parallel."""
    tmp = tmp_path_factory.mktemp("gemv_emu")
    procs = {}
    for name, (code, _) in DTYPES.items():
        cpp = tmp / f"gemv_{name}.cpp"
        cpp.write_text(host_source(code))
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-w", f"-I{HERE}", "-o", str(tmp / name)]
        procs[name] = subprocess.Popen(
            [*cmd, str(cpp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for name, p in procs.items():
        out, _ = p.communicate()
        assert p.returncode == 0, f"g++ failed for {name}:\n{out}"
    return {name: tmp / name for name in DTYPES}


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
