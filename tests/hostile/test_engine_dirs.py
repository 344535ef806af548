"""Hostile engine directories: `llmc run` / `llmc bench` on damaged, tampered and escaping
engines (compiler/engine_files.py, compiler/engine_format.py).

Each row damages a fresh copy of a tiny engine and must fail with EngineError (exit 7), a
message naming the file or key, and no traceback. A target outside the engine is a FIFO: a
loader that opened it would block until the case's time limit, so a row that passes proves the
target was never opened. No message may print a digest or a raw control character.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.engines import SMALL_LIMITS
from helpers.hostile import Case, run_case

TIMEOUT_S = 30.0


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d: Path, m: dict) -> None:
    (d / "manifest.json").write_text(json.dumps(m))


def _edit(d: Path, edit: Callable[[dict], object]) -> None:
    m = _manifest(d)
    edit(m)
    _write_manifest(d, m)


def _rehash(d: Path, *names: str) -> None:
    """Record the files' current checksums: a consistent (tampered, not corrupt) engine."""
    m = _manifest(d)
    for n in names:
        m["files"][n] = hashlib.sha256((d / n).read_bytes()).hexdigest()
    _write_manifest(d, m)


def _list(d: Path, name: str, digest: str = "0" * 64) -> None:
    _edit(d, lambda m: m["files"].__setitem__(name, digest))


def _symlink(d: Path, name: str, target: Path) -> None:
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to(target)


def _edit_plan(d: Path, edit: Callable[[dict], object]) -> None:
    plan = json.loads((d / "plan.json").read_text())
    edit(plan)
    (d / "plan.json").write_text(json.dumps(plan))
    _rehash(d, "plan.json")


def _bytes(d: Path, name: str, data: bytes, rehash: bool = True) -> None:
    (d / name).write_bytes(data)
    if rehash:
        _rehash(d, name)


@dataclass(frozen=True)
class Damage:
    """One hostile engine: ``damage(engine, outside)`` then ``llmc <command>`` fails with 7."""

    name: str
    damage: Callable[[Path, Path], object]
    says: tuple[str, ...]
    command: str = "run"

    def __str__(self) -> str:
        return self.name


ESCAPES = "/x\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"

DAMAGES = [
    # ---- confinement: names that leave the directory, links out, files that are not files
    Damage("absolute path in files", lambda d, o: _list(d, str(o / "fifo")), ("not a relative",)),
    Damage("../ path in files", lambda d, o: _list(d, "../outside/fifo"), ("not a relative",)),
    Damage("./ path in files", lambda d, o: _list(d, "./plan.json"), ("not a relative",)),
    Damage("backslash path", lambda d, o: _list(d, "..\\x"), ("not a relative",)),
    Damage("empty file name", lambda d, o: _list(d, ""), ("non-empty string",)),
    Damage(
        "listed file is a symlink out",
        lambda d, o: (_symlink(d, "leak.json", o / "fifo"), _list(d, "leak.json")),
        ("leak.json", "symbolic link out"),
    ),
    Damage(
        "weights symlink out",
        lambda d, o: _symlink(d, "weights.safetensors", o / "fifo"),
        ("weights.safetensors", "symbolic link out"),
    ),
    Damage(
        "tokenizer_config symlink out",
        lambda d, o: _symlink(d, "tokenizer_config.json", o / "fifo"),
        ("tokenizer_config.json", "symbolic link out"),
    ),
    Damage(
        "unlisted chat template symlink out",
        lambda d, o: _symlink(d, "chat_template.jinja", o / "fifo"),
        ("chat_template.jinja", "symbolic link out"),
    ),
    Damage(
        "manifest symlink out",
        lambda d, o: _symlink(d, "manifest.json", o / "fifo"),
        ("manifest.json", "symbolic link out"),
    ),
    Damage(
        "manifest is a fifo",
        lambda d, o: ((d / "manifest.json").unlink(), os.mkfifo(d / "manifest.json")),
        ("manifest.json", "not a regular file"),
    ),
    Damage(
        "listed file is a fifo",
        lambda d, o: ((d / "plan.json").unlink(), os.mkfifo(d / "plan.json")),
        ("plan.json", "not a regular file"),
    ),
    Damage(
        "kernels dir symlink out",
        lambda d, o: (shutil.rmtree(d / "kernels"), (d / "kernels").symlink_to(o)),
        ("kernels", "symbolic link out"),
    ),
    Damage(
        "unlisted cubin in kernels/",
        lambda d, o: (d / "kernels" / "x.cubin").symlink_to(o / "fifo"),
        ("kernels/x.cubin", "symbolic link out"),
    ),
    Damage(
        "kernel file name with ..",
        lambda d, o: _edit(d, lambda m: m["kernels"].update(files=["../../outside/fifo"])),
        ("kernels.files", "not a relative"),
    ),
    Damage(
        "wrong digest of a file outside",
        lambda d, o: _list(d, "../outside/secret", "1" * 64),
        ("not a relative",),
    ),
    Damage(
        "matching digest of a file outside (the oracle)",
        lambda d, o: _list(d, str(o / "secret"), hashlib.sha256(b"the secret").hexdigest()),
        ("not a relative",),
    ),
    Damage(
        "symlink to a file outside with its digest",
        lambda d, o: (
            _symlink(d, "extra.json", o / "secret"),
            _list(d, "extra.json", hashlib.sha256(b"the secret").hexdigest()),
        ),
        ("extra.json", "symbolic link out"),
    ),
    Damage(
        "corrupt weights",
        lambda d, o: _bytes(d, "weights.safetensors", b"x" * 64, rehash=False),
        ("weights.safetensors is corrupt", "differs"),
    ),
    # ---- tampered manifests and plans (consistent checksums)
    Damage("manifest not JSON", lambda d, o: _bytes(d, "manifest.json", b"{", False), ("JSON",)),
    Damage(
        "manifest not UTF-8",
        lambda d, o: _bytes(d, "manifest.json", b'{"a": "\xff"}', False),
        ("manifest.json", "not UTF-8"),
    ),
    Damage(
        "manifest is a list", lambda d, o: _bytes(d, "manifest.json", b"[]", False), ("object",)
    ),
    Damage(
        "missing model key",
        lambda d, o: _edit(d, lambda m: m["model"].pop("hidden_size")),
        ("model", "'hidden_size'"),
    ),
    Damage(
        "model size as a string",
        lambda d, o: _edit(d, lambda m: m["model"].update(num_layers="2")),
        ("num_layers",),
    ),
    Damage(
        "rope_scaling not an object",
        lambda d, o: _edit(d, lambda m: m["model"].update(rope_scaling=5)),
        ("rope_scaling",),
    ),
    Damage(
        "unknown dtype",
        lambda d, o: _edit(d, lambda m: m["build"].update(dtype="int3")),
        ("dtype", "int3"),
    ),
    Damage(
        "target not a string",
        lambda d, o: _edit(d, lambda m: m["build"].update(target=5)),
        ("target",),
    ),
    Damage("missing build", lambda d, o: _edit(d, lambda m: m.pop("build")), ("'build'",)),
    Damage(
        "hf_config not an object",
        lambda d, o: _edit(d, lambda m: m.update(hf_config=[1])),
        ("hf_config",),
    ),
    Damage(
        "kernels not an object",
        lambda d, o: _edit(d, lambda m: m.update(kernels="x")),
        ("'kernels'",),
    ),
    Damage(
        "checksum not a string",
        lambda d, o: _edit(d, lambda m: m["files"].update({"plan.json": 5})),
        ("plan.json", "sha256 string"),
    ),
    Damage(
        "zero kv bytes",
        lambda d, o: _edit_plan(d, lambda p: p.update(kv_bytes_per_token=0, kv_bytes_per_block=0)),
        ("plan.json", "kv_bytes_per_token"),
    ),
    Damage(
        "negative kv bytes",
        lambda d, o: _edit_plan(d, lambda p: p.update(kv_bytes_per_block=-512)),
        ("plan.json", "kv_bytes_per_block"),
    ),
    Damage(
        "plan missing limits", lambda d, o: _edit_plan(d, lambda p: p.pop("limits")), ("limits",)
    ),
    Damage(
        "plan buffers not a list",
        lambda d, o: _edit_plan(d, lambda p: p.update(buffers=5)),
        ("plan.json",),
    ),
    Damage(
        "plan not UTF-8",
        lambda d, o: _bytes(d, "plan.json", b'{"version": "\xfe"}'),
        ("plan.json", "not UTF-8"),
    ),
    Damage(
        "tokenizer_config not UTF-8",
        lambda d, o: _bytes(d, "tokenizer_config.json", b'{"x": "\xff"}'),
        ("tokenizer_config.json", "not UTF-8"),
    ),
    # ---- escape codes from the manifest in a message (the rebuild command)
    Damage(
        "escape codes in the manifest",
        lambda d, o: (
            _edit(d, lambda m: m["build_config"].update(checkpoint_dir=ESCAPES)),
            _bytes(d, "weights.safetensors", b"x", rehash=False),
        ),
        ("\\x1b[2J",),
    ),
    Damage(
        "escape codes in the version",
        lambda d, o: _edit(d, lambda m: m.update(llmc_version=ESCAPES)),
        ("\\x1b", "rebuild it"),
    ),
    # ---- the same loader behind llmc bench
    Damage(
        "bench: symlink out",
        lambda d, o: _symlink(d, "tokenizer.json", o / "fifo"),
        ("tokenizer.json", "symbolic link out"),
        command="bench",
    ),
    Damage(
        "bench: tampered plan",
        lambda d, o: _edit_plan(d, lambda p: p.update(kv_bytes_per_token=0)),
        ("kv_bytes_per_token",),
        command="bench",
    ),
]

COMMANDS = {
    "run": ["run", "--engine_dir", "{engine}", "--prompt", "hi", "--device", "cpu"],
    "bench": ["bench", "--engine_dir", "{engine}", "--device", "cpu", "--num_requests", "1"],
}


@pytest.fixture(scope="module")
def good_engine(tiny_engine, tiny_llama_dir) -> Path:
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory beside the engine with a FIFO (blocks whoever opens it) and a secret."""
    o = tmp_path / "outside"
    o.mkdir()
    os.mkfifo(o / "fifo")
    (o / "secret").write_text("the secret")
    return o


@pytest.mark.parametrize("row", DAMAGES, ids=str)
def test_damaged_engine_fails_cleanly(row, good_engine, outside, tmp_path):
    engine = tmp_path / "engine"
    shutil.copytree(good_engine, engine)
    row.damage(engine, outside)
    case = Case(row.name, COMMANDS[row.command], 7, row.says, timeout_s=TIMEOUT_S)
    out = run_case(case, engine=engine)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", out.stderr), out.stderr
    assert not re.search(r"\b[0-9a-f]{16,}\b", out.stderr), "a digest was printed"
    secret = hashlib.sha256(b"the secret").hexdigest()
    assert secret[:8] not in out.stderr and "the secret" not in out.stderr


def test_a_symlink_that_stays_inside_is_accepted(good_engine, tmp_path):
    from llmc.compiler.engine_format import load_engine

    engine = tmp_path / "engine"
    shutil.copytree(good_engine, engine)
    (engine / "real").mkdir()
    (engine / "tokenizer.json").rename(engine / "real" / "tokenizer.json")
    (engine / "tokenizer.json").symlink_to("real/tokenizer.json")
    assert load_engine(engine).tokenizer_path == engine / "tokenizer.json"
