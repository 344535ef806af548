"""The cubin cache of ``llmc build`` (llmc.cuda.kernel_cache): a rebuild whose kernel sources,
arch and compiler did not change takes every cubin from the cache; anything else compiles.

The compiler is a stub that writes the cubin (as tests/compiler/test_kernel_build.py), so
this runs on any machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build, kernel_cache_dir
from llmc.cuda import build as kernel_build
from llmc.cuda import kernel_cache


@pytest.fixture
def stub_nvcc(tmp_path, monkeypatch) -> list[str]:
    """nvcc release 13.0 on the PATH; compiling writes the source's length as the cubin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)
    kernel_cache._nvcc_release.cache_clear()
    compiled: list[str] = []

    def fake_nvcc(src: str, arch: str, out: Path, extra: tuple[str, ...] = ()) -> None:
        compiled.append(out.name)
        out.write_bytes(f"cubin {len(src)}".encode())

    monkeypatch.setattr(kernel_build, "nvcc_compile", fake_nvcc)
    monkeypatch.setattr(kernel_build, "nvrtc_compile", lambda *a: pytest.fail("used NVRTC"))
    yield compiled
    kernel_cache._nvcc_release.cache_clear()


def _build(ckpt: Path, out: Path, dtype: str = "float32"):
    cfg = BuildConfig(checkpoint_dir=str(ckpt), output_dir=str(out), dtype=dtype, target="sm_90")
    return build(cfg)


def _files(engine: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((engine / "kernels").iterdir())}


def test_a_rebuild_takes_every_cubin_from_the_cache(tiny_llama_dir, tmp_path, monkeypatch,
                                                     stub_nvcc):  # fmt: skip
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    first = _build(tiny_llama_dir, tmp_path / "e1")
    n = len(stub_nvcc)
    assert n >= 6
    tags = list((tmp_path / "kc").iterdir())
    assert [t.name.split("-")[:2] for t in tags] == [["nvcc", "13.0"]]
    assert sorted(p.name for p in tags[0].iterdir()) == sorted(stub_nvcc)  # no .part left
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in tags[0].iterdir())  # shareable
    second = _build(tiny_llama_dir, tmp_path / "e2")
    assert len(stub_nvcc) == n  # nothing compiled
    assert second.manifest["kernels"] == first.manifest["kernels"]
    assert _files(tmp_path / "e2") == _files(tmp_path / "e1")


def test_other_sources_or_compilers_miss(tiny_llama_dir, tmp_path, monkeypatch, stub_nvcc):
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    _build(tiny_llama_dir, tmp_path / "e1")
    n = len(stub_nvcc)
    _build(tiny_llama_dir, tmp_path / "e2", dtype="bfloat16")  # other macros: other sources
    assert len(stub_nvcc) == 2 * n
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\necho 'release 13.1, V13.1.2'\n")
    kernel_cache._nvcc_release.cache_clear()
    _build(tiny_llama_dir, tmp_path / "e3")
    assert len(stub_nvcc) == 3 * n  # another toolkit: compiled again, kept apart
    assert len(list((tmp_path / "kc").iterdir())) == 2


def test_an_unreadable_version_or_a_broken_entry_compiles(tiny_llama_dir, tmp_path, monkeypatch,
                                                          stub_nvcc):  # fmt: skip
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    _build(tiny_llama_dir, tmp_path / "e1")
    n = len(stub_nvcc)
    (tag,) = (tmp_path / "kc").iterdir()
    for p in tag.iterdir():
        p.write_bytes(b"")  # an empty entry is a miss, never copied into an engine
    _build(tiny_llama_dir, tmp_path / "e2")
    assert len(stub_nvcc) == 2 * n
    assert all(v.startswith(b"cubin") for v in _files(tmp_path / "e2").values())
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")  # no version: no cache
    kernel_cache._nvcc_release.cache_clear()
    _build(tiny_llama_dir, tmp_path / "e3")
    assert len(stub_nvcc) == 3 * n


def test_llmc_kernel_cache_0_turns_it_off(tiny_llama_dir, tmp_path, monkeypatch, stub_nvcc):
    monkeypatch.setenv("LLMC_KERNEL_CACHE", "0")
    assert kernel_cache_dir() is None
    _build(tiny_llama_dir, tmp_path / "e1")
    _build(tiny_llama_dir, tmp_path / "e2")
    assert len(stub_nvcc) == len(set(stub_nvcc)) * 2


def test_default_folder_is_under_llmc_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMC_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    assert kernel_cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernel_cache_dir() == tmp_path / "k"


def test_store_into_an_unwritable_cache_is_ignored(tmp_path):
    cubin = tmp_path / "a.cubin"
    cubin.write_bytes(b"cubin")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    kernel_cache.store(blocker, "nvcc-13.0-x", cubin)  # no error: the build has its cubin
    assert not kernel_cache.fetch(blocker, "nvcc-13.0-x", "a.cubin", tmp_path / "b.cubin")
