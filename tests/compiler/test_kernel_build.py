"""The ``compile`` phase of ``llmc build``: cubins for a CUDA target, none for cpu.

nvcc itself is exercised by tests/cuda/test_cuda_compile.py; here the compiler is replaced by
a stub that writes the cubin, so the phase's wiring (which compiler, which names, what the
manifest lists) is checked on any machine.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from llmc.base.errors import UnsupportedError
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build
from llmc.cuda import build as kernel_build


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)


def _path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only stub executables named ``tools``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    return str(bin_dir)


def _config(ckpt: Path, out: Path, target: str) -> BuildConfig:
    return BuildConfig(
        checkpoint_dir=str(ckpt), output_dir=str(out), dtype="float32", target=target
    )


def test_cpu_target_writes_no_kernels(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_build, "kernel_compiler", lambda: pytest.fail("compiled"))
    result = build(_config(tiny_llama_dir, tmp_path / "e", "cpu"))
    assert result.manifest["kernels"] == {"arch": None, "files": []}
    assert list((tmp_path / "e" / "kernels").iterdir()) == []


def test_cuda_target_cross_compiles_with_nvcc(tiny_llama_dir, tmp_path, monkeypatch):
    """With nvcc on the PATH (no GPU needed) every family's cubin lands in kernels/."""
    compiled: list[str] = []

    def fake_nvcc(src: str, arch: str, out: Path, extra: tuple[str, ...] = ()) -> None:
        assert arch == "sm_90" and 'extern "C" __global__' in src
        compiled.append(out.name)
        out.write_bytes(b"cubin")

    monkeypatch.setenv("PATH", _path_with(tmp_path, "nvcc"))
    monkeypatch.setattr(kernel_build, "nvcc_compile", fake_nvcc)
    monkeypatch.setattr(kernel_build, "nvrtc_compile", lambda *a: pytest.fail("used NVRTC"))
    result = build(_config(tiny_llama_dir, tmp_path / "e", "sm_90"))
    kernels = result.manifest["kernels"]
    assert kernels["arch"] == "sm_90"
    assert kernels["files"] == sorted(compiled) and len(compiled) >= 6
    assert all((tmp_path / "e" / "kernels" / f).read_bytes() == b"cubin" for f in compiled)


def test_without_nvcc_nvrtc_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_with(tmp_path))
    monkeypatch.setattr(kernel_build, "find_spec", lambda name: object())
    assert kernel_build.kernel_compiler() == "nvrtc"


def test_no_kernel_compiler_fails_before_writing(tiny_llama_dir, tmp_path, monkeypatch):
    """Neither nvcc nor CuPy: a CUDA target is refused with the way out; nothing is left."""
    monkeypatch.setenv("PATH", _path_with(tmp_path))
    monkeypatch.setattr(kernel_build, "find_spec", lambda name: None)
    with pytest.raises(UnsupportedError, match=r"nvcc is not on the PATH.*--target cpu"):
        build(_config(tiny_llama_dir, tmp_path / "e", "sm_90"))
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]


def test_kernel_compiler_matches_this_machine():
    if shutil.which("nvcc"):
        assert kernel_build.kernel_compiler() == "nvcc"
    elif importlib.util.find_spec("cupy"):
        assert kernel_build.kernel_compiler() == "nvrtc"
    else:
        with pytest.raises(UnsupportedError):
            kernel_build.kernel_compiler()
