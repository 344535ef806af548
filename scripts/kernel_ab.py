"""A / B of CUDA kernel changes on one GPU: run a GPU script (scripts/pdl_chain.py,
scripts/wo_gemv_quick.py, scripts/gemv_ncu_target.py, ...) with the kernel sources of
another tree and / or extra ``#define``s, so that variants alternate in one device call.

The variant comes from the environment:
- ``KERNEL_SRC=DIR``: the ``.cu`` / ``.cuh`` files of another tree (e.g. ``git archive REV
  cuda | tar -x -C /tmp``), instead of this checkout's ``cuda/``;
- ``KERNEL_DEFINES="NAME=VALUE ..."``: ``#define`` lines put before every family's source.
Kernels load from ``KERNEL_DIR`` (default ``scripts/kernel_ab/``, git-ignored: name it in
the device tool's ``carry``) where a cubin
of the variant's exact source is there — built here with nvcc by ``--prebuild`` (names
carry the source hash, so the variants share one folder) — and compile with NVRTC on the
GPU otherwise. Commands:

    KERNEL_SRC=/tmp/cuda python3 scripts/kernel_ab.py --prebuild gemv_fp8 gemv_wo   # here
    KERNEL_SRC=/tmp/cuda python3 scripts/kernel_ab.py scripts/pdl_chain.py out.json 1  # GPU

(--prebuild compiles for sm_90 and bf16 activations, the config the GEMV scripts use;
``KERNEL_ARCH`` / ``KERNEL_DTYPE`` change that.) Run from outside the checkout on the GPU.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

import llmc.cuda.kernels as kernels

HERE = Path(__file__).resolve().parent
_SOURCE = kernels.source  # this checkout's


def defines() -> str:
    """The ``#define`` lines of ``KERNEL_DEFINES`` ("" when unset)."""
    pairs = os.environ.get("KERNEL_DEFINES", "").split()
    out = []
    for p in pairs:
        name, _, value = p.partition("=")
        out.append(f"#define {name} {value or 1}\n")
    return "".join(out)


def variant_source(family: str, cfg: kernels.KernelConfig | None = None) -> str:
    """``family``'s source text under the environment's variant."""
    return defines() + _SOURCE(family, cfg)


def install() -> Path:
    """Point llmc's kernel sources at the variant and the CUDA backend at the cubin folder;
    returns that folder."""
    if os.environ.get("KERNEL_SRC"):
        kernels.CUDA_DIR = Path(os.environ["KERNEL_SRC"]).resolve()
    kernels.source = variant_source
    kdir = Path(os.environ.get("KERNEL_DIR", HERE / "kernel_ab"))
    from llmc.cuda import cuda_backend

    init = cuda_backend.CudaBackend.__init__

    def init_with_cubins(self: Any, *args: Any, **kw: Any) -> None:
        kw.setdefault("kernels_dir", kdir)
        init(self, *args, **kw)

    cuda_backend.CudaBackend.__init__ = init_with_cubins  # type: ignore[method-assign]
    return kdir


def prebuild(families: list[str]) -> list[Path]:
    """nvcc cubins of ``families`` under the variant into the cubin folder (the ones
    missing); returns every cubin path."""
    from llmc.cuda.build import nvcc_compile

    kdir = install()
    kdir.mkdir(parents=True, exist_ok=True)
    arch = os.environ.get("KERNEL_ARCH", "sm_90")
    cfg = kernels.KernelConfig(
        dtype=os.environ.get("KERNEL_DTYPE", "bfloat16"), head_dim=128, num_q_heads=32,
        num_kv_heads=8, quantization=None,
    )  # fmt: skip
    paths = []
    for fam in families:
        target = kernels.family_arch(fam, arch) or arch
        path = kdir / kernels.cubin_name(fam, cfg, target)
        if not path.is_file():
            nvcc_compile(kernels.source(fam, cfg), target, path)
        paths.append(path)
    return paths


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] == "--prebuild":
        for p in prebuild(argv[1:]):
            print(p)
        return
    install()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
