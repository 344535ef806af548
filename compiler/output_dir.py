"""Where ``llmc build`` and ``llmc import`` write: the output directory's rules, the
temporary directory beside it, the atomic commit, and the cleaning of stale temp dirs.

Rules (every refusal is a ConfigError, exit 3, naming the path; nothing is deleted):

- the output's parent must be a directory (a parent path that is a file is found before any
  work), and the output must not be, contain, or sit inside an input (the checkpoint, the
  GGUF file, the model config);
- an existing output is replaced only with ``force``, and only when it is empty or of the
  writer's own kind: for ``llmc build`` an llmc engine (a ``manifest.json`` that is a JSON
  object with ``format_version`` and ``llmc_version``), for ``llmc import`` a checkpoint
  llmc import wrote (its ``IMPORT_MARKER`` file, a JSON object with ``llmc_version``). A
  symbolic link, a file, or a directory with anything else is refused;
- writing errors of the output filesystem (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) are a
  ConfigError naming the path (``writing``); the temporary directory is made before the long
  work, so a read-only or missing parent fails in seconds, and ``check_free_space`` refuses a
  build whose weights cannot fit on the output filesystem before any weight is read.

Temporary directories are ``.<name>.tmp-*`` beside the output, created with a marker file
(``TMP_MARKER``: host, pid and the pid's start time of the writer). ``make_temp_dir`` first
removes the stale ones of the same parent: a directory is llmc's when it has that marker, and
stale when its writer is gone (same host: no process with that pid and start time; another
host: the marker is older than ``STALE_AFTER_S``). Any other ``.*.tmp-*`` entry is left alone.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmc.base import version
from llmc.base.errors import ConfigError
from llmc.base.text import printable

TMP_MARKER = ".llmc-tmp.json"
IMPORT_MARKER = "llmc_import.json"
STALE_AFTER_S = 24 * 3600
"""A marker from another host is stale after this long (its pid cannot be checked here)."""
_MARKER_MAX_BYTES = 1 << 20
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
KINDS = ("engine", "import")


def _q(path: Path | str) -> str:
    return repr(printable(path))


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in a small regular file (not a link), or None for anything else."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MARKER_MAX_BYTES:
            return None
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def is_llmc_output(path: Path, kind: str) -> bool:
    """Whether ``path`` is a directory llmc wrote as ``kind`` ('engine' or 'import')."""
    if kind == "engine":
        d = _json_object(path / "manifest.json")
        return d is not None and "format_version" in d and "llmc_version" in d
    d = _json_object(path / IMPORT_MARKER)
    return d is not None and "llmc_version" in d


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output_dir(
    output_dir: Path,
    force: bool,
    *,
    kind: str = "engine",
    inputs: Iterable[str | Path | None] = (),
    empty_ok: bool = False,
) -> None:
    """Refuse an output directory the writer may not (re)place (module docstring rules).
    ``empty_ok``: an existing empty directory is accepted without ``force`` too."""
    what = "an llmc engine" if kind == "engine" else "a checkpoint written by llmc import"
    out = output_dir.absolute()
    for parent in out.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise ConfigError(f"output_dir {_q(output_dir)}: {_q(parent)} is not a directory")
            break
    real = out.resolve()
    for given in inputs:
        if given is not None and _overlaps(real, Path(given).expanduser().resolve()):
            raise ConfigError(
                f"output_dir {_q(output_dir)} overlaps the input {_q(given)}; write the output "
                "outside the input (and the input outside the output)"
            )
    if output_dir.is_symlink():
        raise ConfigError(f"output_dir {_q(output_dir)} is a symbolic link; refused")
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise ConfigError(f"output_dir {_q(output_dir)} exists and is not a directory")
    try:
        empty = next(output_dir.iterdir(), None) is None
    except OSError as e:
        raise ConfigError(f"output_dir {_q(output_dir)} cannot be read ({e.strerror})") from e
    if empty and (force or empty_ok):
        return
    if not force:
        raise ConfigError(
            f"output_dir {_q(output_dir)} already exists; pass --force to overwrite it"
        )
    if not is_llmc_output(output_dir, kind):
        raise ConfigError(
            f"output_dir {_q(output_dir)} exists and is not {what} (nor empty); --force "
            "replaces only those: remove it yourself or choose another --output_dir"
        )


def _errno_of(e: OSError) -> int | None:
    if e.errno is not None:
        return e.errno
    m = re.search(r"os error (\d+)", str(e))  # safetensors' Rust errors carry it in the text
    return int(m.group(1)) if m else None


@contextmanager
def writing(output_dir: Path) -> Iterator[None]:
    """Turn an output filesystem's refusal (full, read-only, no permission) into a
    ConfigError naming the output; other errors pass through."""
    try:
        yield
    except OSError as e:
        code = _errno_of(e)
        if code not in _WRITE_ERRNOS:
            raise
        reason = os.strerror(code) if code is not None else str(e)
        raise ConfigError(
            f"cannot write to {_q(output_dir)}: {reason} ({errno.errorcode.get(code, code)}); "
            "free space, fix the permissions, or choose another --output_dir"
        ) from None


def check_free_space(output_dir: Path, need_bytes: int) -> None:
    """Refuse (ConfigError) an output filesystem with less than ``need_bytes`` free."""
    try:
        free = shutil.disk_usage(output_dir.parent).free
    except OSError:
        return  # unknown: the write itself reports a full filesystem
    if need_bytes > free:
        raise ConfigError(
            f"output_dir {_q(output_dir)}: the engine needs about {need_bytes / 2**30:.2f} GiB, "
            f"its filesystem has {free / 2**30:.2f} GiB free; free space or choose another "
            "--output_dir"
        )


# ---- temporary directories ----------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _writer_alive(marker: dict[str, Any]) -> bool:
    pid, host = marker.get("pid"), marker.get("host")
    if host != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        created = marker.get("created_unix")
        return not isinstance(created, (int, float)) or time.time() - created < STALE_AFTER_S
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    start = marker.get("start")
    return start is None or _start_time(pid) in (None, start)


def clean_stale_temp_dirs(parent: Path) -> tuple[str, ...]:
    """Remove the stale temp dirs of interrupted writes in ``parent`` (module docstring);
    returns their paths."""
    cleaned: list[str] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return ()
    for entry in entries:
        if not (entry.name.startswith(".") and ".tmp-" in entry.name) or entry.is_symlink():
            continue
        if not entry.is_dir():
            continue
        marker = _json_object(entry / TMP_MARKER)
        if marker is None or _writer_alive(marker):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            cleaned.append(str(entry))
    return tuple(cleaned)


def make_temp_dir(output_dir: Path) -> tuple[Path, tuple[str, ...]]:
    """(a fresh marked temporary directory beside ``output_dir`` on its filesystem, so the
    rename is atomic; the stale temp dirs removed first)."""
    with writing(output_dir):
        try:
            output_dir.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(
                f"output_dir {_q(output_dir)}: its parent is not a directory"
            ) from None
        cleaned = clean_stale_temp_dirs(output_dir.parent)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
        except OSError as e:  # (full, read-only, no permission: ``writing`` names those)
            if _errno_of(e) in _WRITE_ERRNOS:
                raise
            raise ConfigError(  # e.g. /proc, /sys: a parent that holds no new directory
                f"output_dir {_q(output_dir)}: no directory can be made in "
                f"{_q(output_dir.parent)} ({e.strerror or e}); choose another --output_dir"
            ) from None
        marker = {
            "llmc_version": version.__version__,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "created_unix": time.time(),
            "output_dir": str(output_dir),
        }
        (tmp / TMP_MARKER).write_text(json.dumps(marker))
    return tmp, cleaned


def commit_output_dir(tmp_dir: Path, output_dir: Path, force: bool, kind: str = "engine") -> None:
    """Move the finished ``tmp_dir`` to ``output_dir``, replacing it only as
    ``check_output_dir`` allows (checked again here, just before the replacement)."""
    check_output_dir(output_dir, force, kind=kind, empty_ok=kind == "import")
    (tmp_dir / TMP_MARKER).unlink(missing_ok=True)
    if not output_dir.exists():
        try:
            tmp_dir.rename(output_dir)
        except OSError as e:
            if output_dir.exists():  # created meanwhile (a concurrent write)
                raise ConfigError(f"output_dir {_q(output_dir)} already exists") from e
            raise
        return
    hold, _ = make_temp_dir(output_dir)  # marked: cleaned later if we die before rmtree
    replaced = hold / "replaced"
    output_dir.rename(replaced)
    try:
        tmp_dir.rename(output_dir)
    except BaseException:
        replaced.rename(output_dir)
        raise
    shutil.rmtree(hold, ignore_errors=True)
