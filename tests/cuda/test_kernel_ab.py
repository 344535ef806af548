"""scripts/kernel_ab.py on the CPU: a variant's sources (another tree's files, extra defines)
reach llmc's kernel loader, and ``--prebuild`` writes each cubin under the name the CUDA
backend's loader looks up for that variant (nvcc replaced by a stub)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

import llmc.cuda.kernels as kernels
from llmc.cuda import build as kernel_build
from llmc.cuda import cuda_backend

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel_ab.py"
CFG = kernels.KernelConfig(
    dtype="bfloat16", head_dim=128, num_q_heads=32, num_kv_heads=8, quantization=None
)


@pytest.fixture
def ab(monkeypatch):
    """The script as a module, with every global it patches restored afterwards."""
    monkeypatch.setattr(kernels, "CUDA_DIR", kernels.CUDA_DIR)
    monkeypatch.setattr(kernels, "source", kernels.source)
    monkeypatch.setattr(cuda_backend.CudaBackend, "__init__", cuda_backend.CudaBackend.__init__)
    spec = importlib.util.spec_from_file_location("kernel_ab", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_other_tree_and_defines_reach_the_loader(ab, tmp_path, monkeypatch):
    other = tmp_path / "cuda"
    other.mkdir()
    for p in kernels.CUDA_DIR.iterdir():
        if p.suffix in (".cu", ".cuh"):
            shutil.copy(p, other / p.name)
    (other / "gemv.cu").write_text((other / "gemv.cu").read_text() + "\n// variant B\n")
    mine, name = kernels.source("gemv", CFG), kernels.cubin_name("gemv", CFG, "sm_90")
    monkeypatch.setenv("KERNEL_SRC", str(other))
    monkeypatch.setenv("KERNEL_DEFINES", "G8_X=1 FLAG")
    ab.install()
    got = kernels.source("gemv", CFG)
    assert got.startswith("#define G8_X 1\n#define FLAG 1\n") and got.endswith("// variant B\n")
    assert "variant B" not in mine
    assert kernels.cubin_name("gemv", CFG, "sm_90") != name  # the variant's own cubin


def test_prebuild_names_what_the_backend_loads(ab, tmp_path, monkeypatch):
    written: list[str] = []

    def fake_nvcc(src: str, arch: str, out: Path, extra: tuple[str, ...] = ()) -> None:
        assert src.startswith("#define G8_PROLOGUE_PASSES_ONLY 1\n") and arch == "sm_90"
        written.append(out.name)
        out.write_bytes(b"cubin")

    monkeypatch.setattr(kernel_build, "nvcc_compile", fake_nvcc)
    monkeypatch.setenv("KERNEL_DIR", str(tmp_path / "kdir"))
    monkeypatch.setenv("KERNEL_DEFINES", "G8_PROLOGUE_PASSES_ONLY=1")
    paths = ab.prebuild(["gemv_fp8", "gemv_wo"])
    assert [p.name for p in paths] == written and all(p.is_file() for p in paths)
    # the loader's name for the same variant (CudaBackend's config: other model dims)
    backend_cfg = kernels.KernelConfig(
        dtype="bfloat16", head_dim=64, num_q_heads=9, num_kv_heads=3, quantization="fp8"
    )
    assert kernels.cubin_name("gemv_fp8", backend_cfg, "sm_90") == written[0]
    assert ab.prebuild(["gemv_fp8"]) == paths[:1] and len(written) == 2  # no recompile
    monkeypatch.delenv("KERNEL_DEFINES")
    assert kernels.cubin_name("gemv_fp8", backend_cfg, "sm_90") != written[0]
