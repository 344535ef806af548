"""A content-addressed store of compiled cubins, so that rebuilding an engine whose kernels
did not change skips the compiler (an 8B int4_wo engine's families took nvcc 57 s on a
2-core CPU, the build 0.4 s with them cached: docs/PERFORMANCE.md, 2026-12-07).

A cubin is stored as ``<cache>/<compiler tag>/<cubin name>``: ``llmc.cuda.kernels.cubin_name``
already names the family, its config macros, the target arch and a hash of the complete
source text (headers inlined, macros first); the compiler tag (``nvcc-13.0`` from ``nvcc
--version``'s release, ``nvrtc-12.8`` from NVRTC's) keeps one toolkit's cubins apart from
another's, and the compile flags are part of the tag's hash (``NVCC_FLAGS``). Entries are
written to a temporary name and renamed into place, so a reader never sees half a cubin;
an entry that cannot be read or written is a miss (the build compiles as before).

Invariant: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from llmc.cuda.kernels import NVCC_FLAGS


@functools.lru_cache(maxsize=4)
def _nvcc_release(nvcc: str) -> str | None:
    try:
        res = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", res.stdout)
    return m.group(1) if res.returncode == 0 and m else None


def compiler_tag(compiler: str) -> str | None:
    """``nvcc-<release>-<flags hash>`` or ``nvrtc-<major.minor>-<flags hash>`` of the
    compiler a build uses (``"nvcc"`` or ``"nvrtc"``); None when its version cannot be
    read (then nothing is cached)."""
    if compiler == "nvcc":
        nvcc = shutil.which("nvcc")
        version = _nvcc_release(nvcc) if nvcc else None
    else:
        try:
            from cupy.cuda import nvrtc

            major, minor = nvrtc.getVersion()
            version = f"{major}.{minor}"
        except Exception:  # noqa: BLE001 (no CuPy or no NVRTC: nothing to key on)
            version = None
    if version is None:
        return None
    flags = hashlib.sha256(" ".join(NVCC_FLAGS).encode()).hexdigest()[:8]
    return f"{compiler}-{version}-{flags}"


def fetch(cache: Path, tag: str, name: str, dest: Path) -> bool:
    """Copy the cached cubin ``name`` to ``dest``; False on a miss (absent or unreadable)."""
    src = cache / tag / name
    try:
        if not src.is_file() or src.stat().st_size == 0:
            return False
        shutil.copyfile(src, dest)
    except OSError:
        return False
    return True


def store(cache: Path, tag: str, cubin: Path) -> None:
    """Put a freshly compiled cubin into the cache (written to a temporary name, readable by
    all, renamed into place; errors are ignored: the cache is an optimisation, the build
    already has its cubin)."""
    folder = cache / tag
    tmp: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
        os.close(fd)
        shutil.copyfile(cubin, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / cubin.name)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
