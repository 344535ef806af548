"""The files of an engine directory, confined to it, and the manifest's sections, typed.

An engine directory may come from anywhere, so ``load_engine`` trusts nothing its manifest
says before these checks (each refusal is an EngineError naming the file or key):

- **Confinement.** Every file name the manifest holds (the ``files`` table, ``kernels.files``)
  is a relative, normalized POSIX path with no ``..``; the file, and every directory on the
  way to it, resolves inside the engine directory (a symbolic link is accepted only when it
  resolves inside); it is a regular file. The same holds for the files llmc opens by fixed
  name (manifest.json, plan.json, weights, ``RUNTIME_READS``, ``kernels/``), and each of those
  present must be in the checksum table, as must every entry of ``kernels/``. All of this is
  decided from names, ``lstat`` and ``realpath`` only: a refused target is never opened, read
  or hashed.
- **Content.** Checksums are compared (a mismatch names the file, never a digest); the text
  files (``.json``, ``.jinja``) must be UTF-8.
- **Sections.** ``manifest_sections`` turns ``model``, ``build`` and ``kernels`` into typed
  values or refuses naming the missing or mistyped key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from llmc.base.errors import EngineError, LlmcError
from llmc.base.text import printable
from llmc.compiler.resolve import ResolvedBuild
from llmc.compiler.spec import ModelSpec

RUNTIME_READS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files the runtime opens by name when they are present (runtime/tokenizer.py)."""
TEXT_SUFFIXES = (".json", ".jinja")
LOAD_FORMATS = ("auto", "dummy")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _name(name: object) -> str:
    return printable(repr(name))


def check_name(name: object, where: str) -> str:
    """``name`` when it is a relative, normalized POSIX path without ``..``; else EngineError."""
    if not isinstance(name, str) or not name:
        raise EngineError(f"{where}: file name {_name(name)} is not a non-empty string")
    parts = PurePosixPath(name).parts
    if (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or posixpath.normpath(name) != name
        or any(p in (".", "..") for p in parts)
    ):
        raise EngineError(
            f"{where}: file name {_name(name)} is not a relative path inside the engine "
            "directory; refused"
        )
    return name


def confined(engine_dir: Path, name: object, where: str) -> Path:
    """``engine_dir / name`` when ``name`` is a path the rules above allow (it need not
    exist); EngineError otherwise. Reads no file."""
    path = engine_dir / check_name(name, where)
    root = os.path.realpath(engine_dir)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise EngineError(
            f"{where}: {_name(name)} is a symbolic link out of the engine directory; refused"
        )
    return path


def _regular(path: Path, what: str, fix: str) -> None:
    if not os.path.lexists(path):
        raise EngineError(f"{printable(path)} is missing; the engine is incomplete; {fix}")
    if not path.is_file():  # stat only: a FIFO or device is refused unopened
        raise EngineError(f"{printable(path)}: {what} is not a regular file; refused")


def checksum_table(d: Path, manifest: Mapping[str, Any]) -> dict[str, str]:
    """The manifest's ``files`` table (name → sha256), every name confined."""
    where = printable(d / "manifest.json")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise EngineError(f"{where}: has no 'files' table of checksums")
    for name, digest in files.items():
        confined(d, name, f"{where}: files")
        if not isinstance(digest, str):
            raise EngineError(f"{where}: files[{_name(name)}] must be a sha256 string")
    return files


def check_files(
    d: Path,
    files: Mapping[str, str],
    required: list[str],
    kernel_names: tuple[str, ...],
    *,
    verify_checksums: bool,
    fix: str,
) -> None:
    """Check every file the engine names or llmc opens (module docstring) against the
    ``checksum_table``. ``fix`` ends the messages of a missing or corrupt file."""
    where = printable(d / "manifest.json")
    fixed = [*required, *(n for n in RUNTIME_READS if os.path.lexists(d / n))]
    kernels = d / "kernels"
    if os.path.lexists(kernels):
        confined(d, "kernels", where)
        if not kernels.is_dir():
            raise EngineError(f"{printable(kernels)} is not a directory; refused")
        try:
            fixed += [f"kernels/{e.name}" for e in os.scandir(kernels)]
        except OSError as e:
            raise EngineError(f"{printable(kernels)} cannot be listed ({e.strerror})") from None
    fixed += [f"kernels/{n}" for n in kernel_names]
    for name in fixed:
        confined(d, name, where)
        if name not in files:
            if not os.path.lexists(d / name):
                _regular(d / name, name, fix)
            raise EngineError(f"{where}: no checksum for {_name(name)}; refused")
    for name in files:
        _regular(d / name, name, fix)
    for name in files:
        if name.endswith(TEXT_SUFFIXES):
            try:
                (d / name).read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise EngineError(
                    f"{printable(d / name)} is not UTF-8 text (byte {e.start}); {fix}"
                ) from None
    if verify_checksums:
        for name, digest in files.items():
            if sha256_file(d / name) != digest:
                raise EngineError(
                    f"{printable(d / name)} is corrupt: sha256 differs from the manifest's "
                    f"checksum; {fix}"
                )


def _section(manifest: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = manifest.get(key)
    if value is None:
        raise EngineError(f"{where}: missing section {key!r}")
    if not isinstance(value, dict):
        raise EngineError(f"{where}: section {key!r} must be an object, got {type(value).__name__}")
    return value


def _field_check(
    d: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str, where: str
) -> None:
    if key in d and not ok(d[key]):
        raise EngineError(f"{where}: {key} must be {want}, got {printable(repr(d[key]))}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _model(manifest: Mapping[str, Any], where: str) -> ModelSpec:
    m = _section(manifest, "model", where)
    where = f"{where}: model"
    needed = [
        f.name
        for f in dataclasses.fields(ModelSpec)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for key in needed:
        if key not in m:
            raise EngineError(f"{where}: missing key {key!r}")
    _field_check(m, "architecture", lambda v: isinstance(v, str), "a string", where)
    _field_check(
        m, "rope_scaling", lambda v: v is None or isinstance(v, dict), "an object or null", where
    )
    _field_check(
        m,
        "eos_token_ids",
        lambda v: isinstance(v, list) and all(map(_is_int, v)),
        "a list of integers",
        where,
    )
    for f in dataclasses.fields(ModelSpec):
        if f.type in ("int", "int | None"):
            _field_check(m, f.name, lambda v: _is_int(v) or v is None, "an integer", where)
        elif f.type == "float":
            _field_check(m, f.name, lambda v: isinstance(v, (int, float)), "a number", where)
        elif f.type == "bool":
            _field_check(m, f.name, lambda v: isinstance(v, bool), "true or false", where)
    try:
        return ModelSpec.from_dict(m)
    except (LlmcError, TypeError, ValueError) as e:
        raise EngineError(f"{where}: {printable(e)}") from None


def _build(manifest: Mapping[str, Any], where: str) -> ResolvedBuild:
    b = _section(manifest, "build", where)
    where = f"{where}: build"
    _field_check(b, "target", lambda v: isinstance(v, str), "a string", where)
    _field_check(b, "load_format", lambda v: v in LOAD_FORMATS, f"one of {LOAD_FORMATS}", where)
    _field_check(b, "dummy_seed", lambda v: v is None or _is_int(v), "an integer or null", where)
    try:
        return ResolvedBuild.from_dict(b)
    except (LlmcError, TypeError, ValueError) as e:
        raise EngineError(f"{where}: {printable(e)}") from None


def manifest_sections(
    manifest: Mapping[str, Any], where: str
) -> tuple[ModelSpec, ResolvedBuild, tuple[str, ...]]:
    """(spec, build, kernel file names under kernels/) of a parsed manifest."""
    spec, build = _model(manifest, where), _build(manifest, where)
    for key in ("hf_config", "build_config", "source"):  # read by --peer hf and messages
        _field_check(manifest, key, lambda v: v is None or isinstance(v, dict), "an object", where)
    k = _section(manifest, "kernels", where)
    names = k.get("files")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise EngineError(f"{where}: kernels.files must be a list of file names")
    for n in names:
        check_name(n, f"{where}: kernels.files")
    return spec, build, tuple(names)
