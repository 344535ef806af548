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

The run time shares the store (``runtime_cubin``): a kernel an engine directory does not
hold (CPU-built engines, kernel tests, a config no engine names) is taken from the cache
(nvcc's entries first, then NVRTC's) or compiled once with NVRTC and stored under NVRTC's
tag; a lock file a cubin makes concurrent processes (pytest-xdist workers, several servers)
wait for one compile instead of each running the same one.

Invariant: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from llmc.base.paths import cache_dir
from llmc.cuda.kernels import NVCC_FLAGS, KernelConfig, cubin_name, nvrtc_compile, source


def kernel_cache_dir() -> Path | None:
    """Where compiled cubins are kept between builds and runs: ``$LLMC_KERNEL_CACHE``, else
    ``<LLMC_CACHE>/kernels``; ``LLMC_KERNEL_CACHE=0`` turns it off (every build compiles,
    the run time compiles into a private temporary folder)."""
    env = os.environ.get("LLMC_KERNEL_CACHE")
    if env == "0":
        return None
    return Path(env) if env else cache_dir() / "kernels"


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
    if not _usable(src):
        return False
    try:
        shutil.copyfile(src, dest)
    except OSError:
        return False
    return True


def store(cache: Path, tag: str, cubin: Path) -> None:
    """Put a freshly compiled cubin into the cache (errors are ignored: the cache is an
    optimisation, the build already has its cubin)."""
    folder = cache / tag
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _place(folder / cubin.name, lambda tmp: shutil.copyfile(cubin, tmp))
    except OSError:
        pass


def _place(path: Path, fill: Callable[[Path], object]) -> None:
    """Write ``path`` atomically: ``fill`` writes a temporary file beside it, which is made
    readable by all and renamed into place (so a reader never sees half a cubin); the
    temporary is removed whatever happens."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
    os.close(fd)
    try:
        fill(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``lock`` (created) for the block; none where the
    platform has no ``fcntl``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (not POSIX)
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _usable(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def runtime_cubin(family: str, cfg: KernelConfig, arch: str) -> Path:
    """A cubin of ``family`` under ``cfg`` for ``arch`` for the run time to load: from the
    cache (``kernel_cache_dir()``; nvcc's entry when this machine's nvcc made one, else
    NVRTC's), or compiled with NVRTC into it (once: concurrent callers wait on a lock file and
    then read the first one's entry). With the cache off or unwritable the cubin goes to a
    private temporary folder instead."""
    name = cubin_name(family, cfg, arch)
    root = kernel_cache_dir()
    if root is not None:
        for compiler in ("nvcc", "nvrtc"):
            tag = compiler_tag(compiler)
            if tag is not None and _usable(root / tag / name):
                return root / tag / name
    folder = _writable_folder(root)
    path = folder / name
    with _locked(folder / f"{name}.lock"):
        if not _usable(path):
            _place(path, lambda tmp: nvrtc_compile(source(family, cfg), arch, tmp))
    return path


def _writable_folder(root: Path | None) -> Path:
    """``<root>/<NVRTC tag>`` created, or ``<tmp>/llmc-nvrtc-<uid>`` when the cache is off,
    cannot be written, or NVRTC's version (the tag) cannot be read."""
    tag = compiler_tag("nvrtc")
    if root is not None and tag is not None:
        folder = root / tag
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            pass
    folder = Path(tempfile.gettempdir()) / f"llmc-nvrtc-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
