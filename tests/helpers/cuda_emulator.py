"""Run one of llmc's CUDA kernels on the CPU: the kernel family's source (llmc.cuda.kernels)
compiled as host C++ with g++ over tests/cuda/kernel_emulator.h (one std::thread per CUDA
thread, warp operations through barriers, mma / ldmatrix / cp.async emulated).

``EmulatedFamily(family, cfg, {kernel: nargs}, workdir)`` compiles one program (g++ runs in
the background until first use) whose main() launches the kernel named on its command
line; ``family[kernel](grid, block, *args)`` runs one launch: tensors (CPU, contiguous)
are copied into one blob (each keeping its pointer's alignment modulo 16, so unaligned
views stay unaligned), ints and floats are passed by value (floats exactly, as hex), and
every tensor is copied back afterwards, in place.

The kernel sources mark their PTX helpers ``#ifndef LLMC_HOST_EMULATION``; the emulator
defines host stand-ins of the same names. Skip tests with ``emulator_missing()`` where g++
is absent.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from llmc.cuda.kernels import KernelConfig, source

EMULATOR_DIR = Path(__file__).resolve().parent.parent / "cuda"
_DTYPE_BEGIN = "#if LLMC_DTYPE == 0\ntypedef float scalar_t;"
_DTYPE_END = "// Elements of scalar_t in one 16-byte vector."


def emulator_missing() -> bool:
    return shutil.which("g++") is None


def host_source(family: str, cfg: KernelConfig) -> str:
    """The family's self-contained source as host C++ (common.cuh's PTX dtype section swapped
    for the emulator's)."""
    text = source(family, cfg)
    a, b = text.index(_DTYPE_BEGIN), text.index(_DTYPE_END)
    dtypes = '#define EMU_DTYPE_SECTION\n#include "kernel_emulator.h"\n'
    return '#include "kernel_emulator.h"\n' + text[:a] + dtypes + text[b:]


def _main(kernels: dict[str, int]) -> str:
    calls = "\n".join(
        f'    else if (!strcmp(name, "{k}") && n == {n}) '
        f"emu_launch(grid, block, [&] {{ {k}({', '.join(f'A[{i}]' for i in range(n))}); }});"
        for k, n in kernels.items()
    )
    return f"""
struct EmuArg {{
    char* p = nullptr;
    double v = 0;
    template <class T> operator T*() const {{ return reinterpret_cast<T*>(p); }}
    operator int() const {{ return (int)v; }}
    operator long long() const {{ return (long long)v; }}
    operator float() const {{ return (float)v; }}
}};
int main(int argc, char** argv) {{
    if (argc < 7) return 2;
    const char* name = argv[1];
    std::vector<char> blob = emu_read(argv[2]);
    EmuDim grid{{(unsigned)atoi(argv[3]), (unsigned)atoi(argv[4]), (unsigned)atoi(argv[5])}};
    const int block = atoi(argv[6]);
    const int n = argc - 7;
    std::vector<EmuArg> A(n);
    for (int i = 0; i < n; ++i) {{
        const char* s = argv[7 + i];
        if (s[0] == 'p') A[i].p = blob.data() + atoll(s + 2);
        else A[i].v = strtod(s + 2, nullptr);
    }}
    if (false) {{}}
{calls}
    else return 3;
    emu_write(argv[2], blob);
    return 0;
}}
"""


def compile_program(src: str, binary: Path) -> subprocess.Popen:
    """Start g++ on ``src`` (returns the process: wait on it with ``finish``)."""
    cpp = binary.with_suffix(".cpp")
    cpp.write_text(src)
    cmd = [
        "g++", "-std=c++20", "-O1", "-pthread", "-w", "-no-pie", "-fno-pie",
        "-ffp-contract=off", f"-I{EMULATOR_DIR}", "-o", str(binary), str(cpp),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, what: str) -> None:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"g++ failed for {what}:\n{out[-6000:]}")


class EmulatedFamily:
    """The kernels ``kernels`` (name -> number of arguments) of one family under one config,
    compiled into one host program (see the module docstring)."""

    def __init__(
        self, family: str, cfg: KernelConfig, kernels: dict[str, int], workdir: Path
    ) -> None:
        self.kernels = dict(kernels)
        tag = f"{family}_{cfg.dtype}_{cfg.head_dim}_{cfg.num_q_heads}_{cfg.num_kv_heads}"
        self.binary = Path(workdir) / tag
        self._proc: subprocess.Popen | None = compile_program(
            host_source(family, cfg) + _main(self.kernels), self.binary
        )

    def ready(self) -> EmulatedFamily:
        if self._proc is not None:
            finish(self._proc, self.binary.name)
            self._proc = None
        return self

    def __getitem__(self, name: str):
        if name not in self.kernels:
            raise KeyError(f"{self.binary.name} has no kernel {name!r}")
        return lambda grid, block, *args: self.launch(name, grid, block, *args)

    def launch(self, name: str, grid: tuple[int, ...], block: int, *args: object) -> None:
        self.ready()
        if len(args) != self.kernels[name]:
            raise TypeError(f"{name}: {self.kernels[name]} arguments, got {len(args)}")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        chunks: list[bytes] = []
        offsets: list[int | None] = []
        argv: list[str] = []
        pos = 0
        for a in args:
            if isinstance(a, torch.Tensor):
                assert a.device.type == "cpu" and a.is_contiguous(), "CPU contiguous tensors"
                pad = (-pos) % 256 + a.data_ptr() % 16
                chunks.append(b"\0" * pad)
                pos += pad
                data = a.view(torch.uint8).numpy().tobytes() if a.numel() else b""
                offsets.append(pos)
                argv.append(f"p:{pos}")
                chunks.append(data)
                pos += len(data)
            else:
                offsets.append(None)
                v = float(np.float32(a)) if isinstance(a, float | np.floating) else int(a)
                argv.append(f"n:{float(v).hex()}")
        blob = Path(f"{self.binary}.{name}.blob")
        blob.write_bytes(b"".join(chunks) + b"\0" * 256)
        cmd = [str(self.binary), name, str(blob), *map(str, grid), str(block), *argv]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise AssertionError(f"{name} emulation failed ({res.returncode}): {res.stderr}")
        out = blob.read_bytes()
        for a, off in zip(args, offsets, strict=True):
            if off is not None and a.numel():
                raw = bytearray(out[off : off + a.numel() * a.element_size()])
                a.view(torch.uint8).copy_(
                    torch.frombuffer(raw, dtype=torch.uint8).view_as(a.view(torch.uint8))
                )
