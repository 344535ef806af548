"""Kernel sources, their compile-time constants, and loading them as CuPy kernels.

One ``.cu`` file per kernel family (this folder). A family is compiled per *kernel
config*: the activation dtype plus, for the attention-shaped families, the model
constants head_dim / num_q_heads / num_kv_heads (baked in as macros, so register arrays
and loops are sized at compile time). Everything else (token counts, hidden sizes, block
size, vocab) is a run-time argument.

The source handed to a compiler is self-contained: the ``#define`` lines of the config,
then the file with each ``#include "<name>.cuh"`` of this folder (common.cuh, fp8.cuh,
sm90.cuh, ...) replaced by that header's text, once per header. The same text goes to nvcc
(``llmc.cuda.build``) and NVRTC (here), so a cubin in an engine's ``kernels/`` directory and
a run-time compile are the same program. File names of cubins carry the config key; a
missing or stale cubin is taken from the kernel cache or compiled into it with NVRTC
(``llmc.cuda.kernel_cache.runtime_cubin``: once a machine, whatever the processes), by
``llmc.cuda.kernel_library.KernelLibrary``.

Invariant: importing this module needs neither CuPy nor a GPU (CPU tests and the engine
builder use the source helpers); ``KernelLibrary`` (``llmc.cuda.kernel_library``) loads the
cubins as CuPy kernels.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.base.errors import UnsupportedError, check_positive_ints

CUDA_DIR = Path(__file__).resolve().parent
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
NVCC_FLAGS = ("-std=c++17", "-O3")
STATIC_SMEM_BYTES = 48 * 1024
"""The most static (``__shared__``) memory one kernel may declare."""

# family -> (source file, uses model constants)
FAMILIES: dict[str, tuple[str, bool]] = {
    "embedding": ("embedding.cu", False),
    "rmsnorm": ("rmsnorm.cu", False),
    "activation": ("activation.cu", False),
    "quantize": ("quantize.cu", False),
    "rope_kv": ("rope_kv.cu", True),
    "decode_attention": ("decode_attention.cu", True),
    "prefill_attention": ("prefill_attention.cu", True),
    "prefill_sm90": ("prefill_attention_sm90.cu", True),
    "sampling": ("sampling.cu", False),
    "gemv": ("gemv.cu", False),
    "gemv_fp8": ("gemv_fp8.cu", False),
    "gemv_wo": ("gemv_wo.cu", False),
    "wo_dequant": ("wo_dequant.cu", False),
    "gemm_wo": ("gemm_wo.cu", False),
    "gemm_wo_sm90": ("gemm_wo_sm90.cu", False),
}
WO_QUANTIZATIONS = ("int8_wo", "int4_wo", "gguf")
# Families an engine needs only under some ``--quantization`` values (engine builds compile
# them only there; a KernelConfig without a quantization, the run time's, has them all).
QUANTIZED_FAMILIES: dict[str, tuple[str, ...]] = {
    "gemv_fp8": ("fp8",),
    "gemv_wo": WO_QUANTIZATIONS,
    "wo_dequant": WO_QUANTIZATIONS,
    "gemm_wo": WO_QUANTIZATIONS,
    "gemm_wo_sm90": WO_QUANTIZATIONS,
}


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time constants of one engine's kernels. ``quantization`` (an engine's
    ``--quantization``; None = any) only selects families (``QUANTIZED_FAMILIES``): it is no
    macro, so it never changes a cubin."""

    dtype: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise UnsupportedError(
                f"kernel dtype {self.dtype!r} is not supported; choose one of "
                f"{', '.join(DTYPE_CODES)}"
            )
        heads = ("head_dim", "num_q_heads", "num_kv_heads")
        check_positive_ints({n: getattr(self, n) for n in heads}, "kernel config", UnsupportedError)
        if self.num_q_heads % self.num_kv_heads:
            raise UnsupportedError(
                f"kernel config: num_q_heads ({self.num_q_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedError(f"kernel config: head_dim must be even, got {self.head_dim}")

    @classmethod
    def from_spec(cls, spec: Any, dtype: str, quantization: str | None = None) -> KernelConfig:
        """From a ``ModelSpec``, the engine dtype and (builds) its quantization."""
        return cls(dtype, spec.head_dim, spec.num_heads, spec.num_kv_heads, quantization)

    @property
    def tensor_core_prefill(self) -> bool:
        """Whether prefill_attention.cu has a kernel for this config (16-bit, hd % 16 == 0)."""
        return self.dtype != "float32" and self.head_dim % 16 == 0

    @property
    def cluster_warps(self) -> int:
        """Warps per CTA of decode_attention.cu's cluster kernel (its ``CNW``): 8, or fewer
        where 8 warps' states of G = nq / nkv heads would pass the 48 KiB of static shared
        memory a kernel may declare (G = 16 at head_dim 128 needs 74,880 bytes with 8)."""
        g, hd = self.num_q_heads // self.num_kv_heads, self.head_dim
        for warps in (8, 4, 2, 1):
            if ((warps + 1) * g * (hd + 2)) * 4 + 4 <= STATIC_SMEM_BYTES:
                return warps
        return 1

    @property
    def sm90_prefill(self) -> bool:
        """Whether prefill_attention_sm90.cu has kernels for this config (16-bit, hd 64/128)."""
        return self.dtype != "float32" and self.head_dim in (64, 128)


_WO_MMA_FAMILIES = ("gemv_wo", "gemm_wo", "gemm_wo_sm90")  # 16-bit activations only
# Families built only for one arch, with the arch-specific ("a") features their PTX uses
# (wgmma, setmaxnreg exist on sm_90a and nowhere else): family -> (device arch, build arch).
ARCH_SPECIFIC: dict[str, tuple[str, str]] = {
    "prefill_sm90": ("sm_90", "sm_90a"),
    "gemm_wo_sm90": ("sm_90", "sm_90a"),
}


def family_arch(family: str, arch: str) -> str | None:
    """The arch ``family`` is compiled for on an ``arch`` device; None when it has no
    kernels there (an arch-specific family on another arch)."""
    if family not in ARCH_SPECIFIC:
        return arch
    device_arch, build_arch = ARCH_SPECIFIC[family]
    return build_arch if arch == device_arch else None


def has_kernels(family: str, cfg: KernelConfig, arch: str | None = None) -> bool:
    """Whether ``family`` has kernels under ``cfg`` (on ``arch``, when given)."""
    if family == "prefill_attention" and not cfg.tensor_core_prefill:
        return False
    if family == "prefill_sm90" and not cfg.sm90_prefill:
        return False
    if family in _WO_MMA_FAMILIES and cfg.dtype == "float32":  # 16-bit mma operands only
        return False
    wanted = QUANTIZED_FAMILIES.get(family)
    if wanted is not None and cfg.quantization is not None and cfg.quantization not in wanted:
        return False
    return arch is None or family_arch(family, arch) is not None


def macros(family: str, cfg: KernelConfig) -> dict[str, int]:
    """The ``#define``s of ``family`` under ``cfg`` (only those the family reads)."""
    if family not in FAMILIES:
        raise UnsupportedError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    if family == "sampling":
        return {}
    m = {"LLMC_DTYPE": DTYPE_CODES[cfg.dtype]}
    if FAMILIES[family][1]:
        m.update(HEAD_DIM=cfg.head_dim, NUM_Q_HEADS=cfg.num_q_heads, NUM_KV_HEADS=cfg.num_kv_heads)
    if family == "decode_attention":
        m["CLUSTER_WARPS"] = cfg.cluster_warps
    return m


_LOCAL_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"\n', re.M)


def _inline_headers(text: str, seen: set[str]) -> str:
    """``text`` with this folder's headers inlined, each once (as ``#pragma once`` would)."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        header = (CUDA_DIR / name).read_text().replace("#pragma once\n", "")
        return _inline_headers(header, seen)

    return _LOCAL_INCLUDE.sub(one, text)


def source(family: str, cfg: KernelConfig | None = None) -> str:
    """Self-contained source text of ``family`` (config macros first, headers inlined)."""
    file, _ = FAMILIES[family]
    text = _inline_headers((CUDA_DIR / file).read_text(), set())
    defines = "".join(f"#define {k} {v}\n" for k, v in (macros(family, cfg) if cfg else {}).items())
    return defines + text


def cubin_name(family: str, cfg: KernelConfig, arch: str) -> str:
    """File name of a family's cubin: family, readable config, and a hash of the source."""
    m = macros(family, cfg)
    tag = "-".join(f"{k.lower()}{v}" for k, v in m.items()) or "any"
    digest = hashlib.sha256(source(family, cfg).encode()).hexdigest()[:10]
    return f"{family}.{tag}.{arch}.{digest}.cubin"


def nvrtc_compile(src: str, arch: str, out: Path) -> None:
    """Compile self-contained source text to a cubin with NVRTC (CuPy's bindings)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(src, out.stem + ".cu", [], [])
    try:
        opts = ["-std=c++17", f"--gpu-architecture={arch}"]  # CuPy encodes each option
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise UnsupportedError(f"NVRTC failed for {out.name}: {e}\n{log}") from e
        out.write_bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
