"""The cubin cache of ``llmc build`` (llmc.cuda.kernel_cache): a rebuild whose kernel sources,
arch and compiler did not change takes every cubin from the cache; anything else compiles.

The compiler is a stub that writes the cubin (as tests/compiler/test_kernel_build.py), so
this runs on any machine.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmc.base.errors import UnsupportedError
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build
from llmc.cuda import build as kernel_build
from llmc.cuda import kernel_cache
from llmc.cuda.kernel_cache import kernel_cache_dir
from llmc.cuda.kernels import KernelConfig, cubin_name


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


# -- the run time's share of the cache (runtime_cubin) -------------------------------------

_CFG = KernelConfig("bfloat16", 64, 4, 2)


@pytest.fixture
def stub_nvrtc(monkeypatch) -> list[str]:
    """NVRTC 13.0 (its tag) whose compile writes a cubin after a short sleep (so concurrent
    callers overlap); records the cubin names it compiled."""
    compiled: list[str] = []

    def fake_nvrtc(src: str, arch: str, out: Path) -> None:
        compiled.append(arch)
        time.sleep(0.05)
        out.write_bytes(f"nvrtc {arch} {len(src)}".encode())

    tags = {"nvrtc": "nvrtc-13.0-x", "nvcc": None}
    monkeypatch.setattr(kernel_cache, "nvrtc_compile", fake_nvrtc)
    monkeypatch.setattr(kernel_cache, "compiler_tag", lambda c: tags[c])
    yield compiled, tags  # the test may give nvcc a tag


def test_runtime_compiles_once_into_the_cache_and_then_reads_it(tmp_path, monkeypatch,
                                                                stub_nvrtc):  # fmt: skip
    compiled, _ = stub_nvrtc
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    name = cubin_name("rmsnorm", _CFG, "sm_90")
    path = kernel_cache.runtime_cubin("rmsnorm", _CFG, "sm_90")
    assert path == tmp_path / "kc" / "nvrtc-13.0-x" / name
    assert path.read_bytes().startswith(b"nvrtc sm_90")
    assert kernel_cache.runtime_cubin("rmsnorm", _CFG, "sm_90") == path
    assert compiled == ["sm_90"]
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".part"] == []


def test_runtime_prefers_a_cubin_nvcc_made(tmp_path, monkeypatch, stub_nvrtc):
    compiled, tags = stub_nvrtc
    tags["nvcc"] = "nvcc-13.0-y"
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    name = cubin_name("decode_attention", _CFG, "sm_90")
    prebuilt = tmp_path / "kc" / "nvcc-13.0-y" / name
    prebuilt.parent.mkdir(parents=True)
    prebuilt.write_bytes(b"from nvcc")
    assert kernel_cache.runtime_cubin("decode_attention", _CFG, "sm_90") == prebuilt
    empty = tmp_path / "kc" / "nvcc-13.0-y" / cubin_name("rope_kv", _CFG, "sm_90")
    empty.write_bytes(b"")  # half-written by someone: not used, compiled instead
    assert kernel_cache.runtime_cubin("rope_kv", _CFG, "sm_90").parent.name == "nvrtc-13.0-x"
    assert compiled == ["sm_90"]


def test_concurrent_runtimes_compile_a_cubin_once(tmp_path, monkeypatch, stub_nvrtc):
    compiled, _ = stub_nvrtc
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    with ThreadPoolExecutor(6) as pool:
        paths = list(pool.map(lambda _: kernel_cache.runtime_cubin("gemv", _CFG, "sm_90"),
                              range(6)))  # fmt: skip
    assert len(set(paths)) == 1 and compiled == ["sm_90"]


def test_runtime_without_a_cache_compiles_into_a_private_folder(tmp_path, monkeypatch,
                                                                stub_nvrtc):  # fmt: skip
    _, tags = stub_nvrtc
    monkeypatch.setenv("LLMC_KERNEL_CACHE", "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = kernel_cache.runtime_cubin("sampling", _CFG, "sm_90")
    assert path.parent == tmp_path / "tmp" / f"llmc-nvrtc-{os.getuid()}"
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(blocker))  # unwritable: the private folder
    assert kernel_cache.runtime_cubin("sampling", _CFG, "sm_90") == path
    tags["nvrtc"] = None  # NVRTC's version unknown: nothing untagged goes into the cache
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))
    assert kernel_cache.runtime_cubin("sampling", _CFG, "sm_90") == path
    assert not (tmp_path / "kc").exists()


def test_a_failed_compile_leaves_no_entry(tmp_path, monkeypatch, stub_nvrtc):
    monkeypatch.setenv("LLMC_KERNEL_CACHE", str(tmp_path / "kc"))

    def broken(src: str, arch: str, out: Path) -> None:
        out.write_bytes(b"half")
        raise UnsupportedError("NVRTC failed for x")

    monkeypatch.setattr(kernel_cache, "nvrtc_compile", broken)
    with pytest.raises(UnsupportedError):
        kernel_cache.runtime_cubin("embedding", _CFG, "sm_90")
    folder = tmp_path / "kc" / "nvrtc-13.0-x"
    assert sorted(p.suffix for p in folder.iterdir()) == [".lock"]
