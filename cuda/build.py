"""Compile an engine's kernels to cubins at build time.

``compile_engine_kernels(spec, dtype, arch, out_dir)`` writes one cubin per kernel family
(named by ``llmc.cuda.kernels.cubin_name``) into ``out_dir`` and returns their paths. It
uses ``nvcc -cubin -arch=<arch>`` when nvcc is on the PATH (in parallel, one process per
family; no GPU needed: a CPU machine cross-compiles), else NVRTC through CuPy's bindings
(``cupy.cuda.nvrtc``); with neither, it raises UnsupportedError before compiling anything
(build for ``--target cpu`` there). The run time loads these cubins without compiling
(``llmc.cuda.kernel_library.KernelLibrary(kernel_dir=...)``).

Invariant: importing this module needs neither CuPy nor a GPU (the engine builder imports it).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

from llmc.base.errors import UnsupportedError
from llmc.cuda import kernel_cache
from llmc.cuda.kernels import (
    FAMILIES,
    NVCC_FLAGS,
    KernelConfig,
    cubin_name,
    family_arch,
    has_kernels,
    nvrtc_compile,
    source,
)


def families_for(cfg: KernelConfig, arch: str | None = None) -> list[str]:
    """Families that have kernels under ``cfg`` (no tensor-core prefill for fp32; the sm_90a
    prefill only for 16-bit head_dim 64 / 128, and only on sm_90 when ``arch`` is given; the
    fp8 / weight-only GEMVs only under their quantizations when ``cfg`` names one)."""
    return [f for f in FAMILIES if has_kernels(f, cfg, arch)]


def arch_flags(arch: str) -> list[str]:
    """nvcc target flags: ``-arch=sm_XY``; arch-specific targets (``sm_90a``) in the
    ``-gencode`` form, which assembles only that target."""
    if arch.endswith("a"):
        return [f"-gencode=arch=compute_{arch[3:]},code={arch}"]
    return [f"-arch={arch}"]


MIN_SM = 80
"""The oldest arch the kernels build for: bf16/fp16 ``mma.sync m16n8k16`` and ``cp.async``
are Ampere's (sm_80)."""


def _check_arch(arch: str) -> None:
    if not (arch.startswith("sm_") and arch[3:].isdigit()):
        raise UnsupportedError(f"kernel target {arch!r} is not a CUDA arch like sm_90")


def check_min_arch(arch: str) -> None:
    """Refuse a CUDA target below ``MIN_SM`` (UnsupportedError, exit 5)."""
    _check_arch(arch)
    if int(arch[3:]) < MIN_SM:
        raise UnsupportedError(
            f"target {arch}: llmc's CUDA kernels need sm_{MIN_SM} or newer (Ampere: bf16 "
            "tensor cores, cp.async); --target cpu builds an engine for the torch backend"
        )


def check_target(arch: str) -> None:
    """Refuse, before any weight is read, a CUDA target the kernels cannot be built for
    (UnsupportedError, exit 5): below ``MIN_SM``, or an arch this machine's nvcc does not
    know (``nvcc --list-gpu-code``; not asked where nvcc is absent: NVRTC then reports it
    at compile time)."""
    check_min_arch(arch)
    known = nvcc_archs()
    if known and arch not in known:
        raise UnsupportedError(
            f"target {arch} is not a GPU arch nvcc knows; it builds for "
            f"{', '.join(a for a in known if int(a[3:]) >= MIN_SM)}"
        )


def nvcc_archs() -> tuple[str, ...]:
    """The ``sm_XY`` targets of the nvcc on the PATH, oldest first (empty without nvcc or
    when it cannot say)."""
    nvcc = shutil.which("nvcc")
    return () if nvcc is None else _archs_of(nvcc)


@functools.lru_cache(maxsize=4)
def _archs_of(nvcc: str) -> tuple[str, ...]:
    """``nvcc --list-gpu-code`` of that nvcc (asked once per path and process)."""
    try:
        res = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ()
    archs = {a for a in res.stdout.split() if a.startswith("sm_") and a[3:].isdigit()}
    return tuple(sorted(archs, key=lambda a: int(a[3:]))) if res.returncode == 0 else ()


def nvcc_compile(src: str, arch: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    """Compile self-contained source text to ``out`` (a cubin) with nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise UnsupportedError("nvcc is not on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / (out.stem + ".cu")
        cu.write_text(src)
        cmd = [nvcc, "-cubin", *arch_flags(arch), *NVCC_FLAGS, *extra, "-o", str(out), str(cu)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise UnsupportedError(
                f"nvcc failed for {out.name} ({' '.join(cmd)}):\n{res.stderr.strip()}"
            )


def kernel_compiler() -> str:
    """``"nvcc"`` when it is on the PATH, else ``"nvrtc"`` when CuPy is installed.

    UnsupportedError when neither is: a CUDA target cannot be built on this machine.
    """
    if shutil.which("nvcc") is not None:
        return "nvcc"
    if find_spec("cupy") is not None:
        return "nvrtc"
    raise UnsupportedError(
        "cannot compile kernels for a CUDA target: nvcc is not on the PATH and CuPy (NVRTC) "
        "is not installed; install the CUDA toolkit or cupy-cuda12x, or build --target cpu"
    )


def compile_engine_kernels(
    spec,
    dtype: str,
    arch: str,
    out_dir: Path,
    quantization: str | None = None,
    cache: Path | None = None,
) -> list[Path]:
    """Compile every kernel family for ``spec`` / ``dtype`` / ``arch`` into ``out_dir``.

    ``spec`` is a ``llmc.compiler.spec.ModelSpec``; ``quantization`` the engine's
    ``--quantization`` (families only some quantizations run, ``QUANTIZED_FAMILIES``, are
    compiled for those only; None: every family); ``cache`` a folder of cubins compiled
    before (``llmc.cuda.kernel_cache``: taken from there when the source, arch and compiler
    match, stored there after compiling; None: always compile). Returns the written cubin
    paths.
    """
    _check_arch(arch)
    cfg = KernelConfig.from_spec(spec, dtype, quantization)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    compiler = kernel_compiler()
    use_nvcc = compiler == "nvcc"
    tag = kernel_cache.compiler_tag(compiler) if cache is not None else None
    jobs = [(f, family_arch(f, arch) or arch) for f in families_for(cfg, arch)]

    def one(job: tuple[str, str]) -> Path:
        family, family_target = job
        path = out_dir / cubin_name(family, cfg, family_target)
        if tag is not None and kernel_cache.fetch(cache, tag, path.name, path):
            return path
        src = source(family, cfg)
        if use_nvcc:
            nvcc_compile(src, family_target, path)
        else:
            nvrtc_compile(src, family_target, path)
        if tag is not None:
            kernel_cache.store(cache, tag, path)
        return path

    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))
