"""Hostile environments: where `llmc build` / `llmc import` write, and the files `llmc compare`
reads (compiler/output_dir.py, cli/compare_cmd.py, compiler/memory_plan.py).

The table rows run `llmc` in a child process (tests/helpers/hostile.py): each must fail with
its documented code, name the path or key, and delete nothing it was not asked to. The
in-process rows fake what a root test process cannot make real (a read-only or full
filesystem) and cover the build's own promises: stale temp dirs cleaned and reported, a
progress callback that raises, capacity errors that only suggest values that would work.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.engines import SMALL_LIMITS, tiny_build_config
from helpers.hostile import Case, run_case
from llmc.base.errors import CapacityError, ConfigError

BUILD = ["build", "--checkpoint_dir", "{ckpt}", "--target", "cpu", "--dtype", "float32"]
IMPORT = ["import", "--gguf", "{tmp}/m.gguf"]


def _result(**aggregates: object) -> dict:
    agg = {"request_throughput": 1.0, "output_tokens_per_s": 2.0, "percentiles": [50, 99]}
    return {"schema": "llmc.bench", "aggregates": {**agg, **aggregates}}


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())


def _files(a: object, b: object = None) -> Callable[[Path, Path], None]:
    """A setup writing result file a.json (and b.json)."""

    def setup(tmp: Path, ckpt: Path) -> None:
        _write(tmp / "a.json", a)
        if b is not None:
            _write(tmp / "b.json", b)

    return setup


def _unrelated(d: Path) -> None:
    d.mkdir()
    (d / "notes.txt").write_text("mine")


def _engine_like(d: Path, manifest: dict) -> None:
    _unrelated(d)
    (d / "manifest.json").write_text(json.dumps(manifest))


@dataclass(frozen=True)
class Row:
    """``setup(tmp, ckpt)``, then ``llmc ARGS`` fails with ``exit_code``; ``kept`` survive."""

    name: str
    setup: Callable[[Path, Path], object]
    args: list[str]
    exit_code: int
    says: tuple[str, ...]
    kept: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name


def _nothing(tmp: Path, ckpt: Path) -> None:
    pass


ROWS = [
    # ---- --force replaces only what llmc wrote (or an empty directory)
    Row(
        "build --force over unrelated files",
        lambda t, c: _unrelated(t / "out"),
        [*BUILD, "--output_dir", "{tmp}/out", "--force"],
        3,
        ("{tmp}/out", "not an llmc engine"),
        ("out/notes.txt",),
    ),
    Row(
        "build --force over a web app's manifest.json",
        lambda t, c: _engine_like(t / "out", {"name": "my app", "icons": []}),
        [*BUILD, "--output_dir", "{tmp}/out", "--force"],
        3,
        ("not an llmc engine",),
        ("out/notes.txt", "out/manifest.json"),
    ),
    Row(
        "build --force over a symlink",
        lambda t, c: (_unrelated(t / "real"), (t / "out").symlink_to(t / "real")),
        [*BUILD, "--output_dir", "{tmp}/out", "--force"],
        3,
        ("symbolic link",),
        ("real/notes.txt",),
    ),
    Row(  # a kernel filesystem: mkdir there fails with ENOENT, not a permission error
        "build into /proc",
        _nothing,
        [*BUILD, "--output_dir", "/proc/llmc-engine"],
        3,
        ("/proc/llmc-engine", "no directory can be made in '/proc'"),
    ),
    Row(
        "build --force over a file",
        lambda t, c: (t / "out").write_text("a file"),
        [*BUILD, "--output_dir", "{tmp}/out", "--force"],
        3,
        ("{tmp}/out", "not a directory"),
        ("out",),
    ),
    Row(
        "import --force over unrelated files",
        lambda t, c: (_unrelated(t / "out"), _write(t / "m.gguf", b"GGUF")),
        [*IMPORT, "--output_dir", "{tmp}/out", "--force"],
        3,
        ("{tmp}/out", "not a checkpoint written by llmc import"),
        ("out/notes.txt",),
    ),
    Row(
        "import --force over an engine",
        lambda t, c: (
            _engine_like(t / "out", {"format_version": 1, "llmc_version": "0"}),
            _write(t / "m.gguf", b"GGUF"),
        ),
        [*IMPORT, "--output_dir", "{tmp}/out", "--force"],
        3,
        ("not a checkpoint written by llmc import",),
        ("out/notes.txt",),
    ),
    # ---- the output location
    Row(
        "build: output parent is a file",
        lambda t, c: (t / "f").write_text("x"),
        [*BUILD, "--output_dir", "{tmp}/f/engine"],
        3,
        ("{tmp}/f", "not a directory"),
        ("f",),
    ),
    Row(
        "import: output parent is a file",
        lambda t, c: ((t / "f").write_text("x"), _write(t / "m.gguf", b"GGUF")),
        [*IMPORT, "--output_dir", "{tmp}/f/hf"],
        3,
        ("{tmp}/f", "not a directory"),
        ("f",),
    ),
    Row(
        "build: output inside the checkpoint",
        lambda t, c: shutil.copytree(c, t / "ck"),
        ["build", "--checkpoint_dir", "{tmp}/ck", "--output_dir", "{tmp}/ck/engine"],
        3,
        ("overlaps the input",),
        ("ck/config.json",),
    ),
    Row(
        "build: output is the checkpoint",
        lambda t, c: shutil.copytree(c, t / "ck"),
        ["build", "--checkpoint_dir", "{tmp}/ck", "--output_dir", "{tmp}/ck", "--force"],
        3,
        ("overlaps the input",),
        ("ck/config.json",),
    ),
    Row(
        "build: checkpoint inside the output",
        lambda t, c: shutil.copytree(c, t / "out" / "ck"),
        ["build", "--checkpoint_dir", "{tmp}/out/ck", "--output_dir", "{tmp}/out", "--force"],
        3,
        ("overlaps the input",),
        ("out/ck/config.json",),
    ),
    Row(
        "import: output is the GGUF file's path",
        lambda t, c: _write(t / "m.gguf", b"GGUF"),
        [*IMPORT, "--output_dir", "{tmp}/m.gguf", "--force"],
        3,
        ("overlaps the input",),
        ("m.gguf",),
    ),
    # ---- capacity: the suggestion is a value that works, or none
    Row(
        "capacity with no block left",
        _nothing,
        [*BUILD, "--dry_run", "--gpu_memory_gb", "0.0001"],
        6,
        ("does not fit", "no --max_seq_len fits"),
    ),
    # ---- llmc compare on damaged result files
    Row(
        "compare: numbers stored as strings",
        _files(_result(), _result(output_tokens_per_s="2.0")),
        ["compare", "{tmp}/a.json", "{tmp}/b.json"],
        2,
        ("{tmp}/b.json", "aggregates.output_tokens_per_s", "a number"),
    ),
    Row(
        "compare: missing aggregates",
        _files(_result(), {"schema": "llmc.bench"}),
        ["compare", "{tmp}/a.json", "{tmp}/b.json"],
        2,
        ("{tmp}/b.json", "'aggregates'"),
    ),
    Row(
        "compare: a section that is not an object",
        _files(_result(ttft=[1, 2]), _result()),
        ["compare", "{tmp}/a.json", "{tmp}/b.json"],
        2,
        ("{tmp}/a.json", "aggregates.ttft", "an object"),
    ),
    Row(
        "compare: percentiles as strings",
        _files(_result(percentiles=["99"]), _result()),
        ["compare", "{tmp}/a.json", "{tmp}/b.json"],
        2,
        ("aggregates.percentiles",),
    ),
    Row(
        "compare: config not an object",
        _files({**_result(), "config": "x"}, _result()),
        ["compare", "{tmp}/a.json", "{tmp}/b.json"],
        2,
        ("{tmp}/a.json", "config"),
    ),
    Row(
        "compare: peer run malformed",
        _files({**_result(), "peer": {"aggregates": {"e2e": {"mean": "1"}}}}),
        ["compare", "{tmp}/a.json"],
        2,
        ("peer.aggregates.e2e.mean",),
    ),
    Row(
        "compare: not UTF-8",
        _files(_result(), b'{"schema": "\xff"}'),
        ["compare", "{tmp}/a.json", "{tmp}/b.json"],
        2,
        ("{tmp}/b.json", "not UTF-8"),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_environment_fails_cleanly(row, tmp_path, tiny_llama_dir):
    row.setup(tmp_path, tiny_llama_dir)
    before = {p: (tmp_path / p).read_bytes() for p in row.kept if (tmp_path / p).is_file()}
    case = Case(row.name, row.args, row.exit_code, row.says)
    out = run_case(case, tmp=tmp_path, ckpt=tiny_llama_dir)
    for p in row.kept:
        assert (tmp_path / p).exists(), f"{p} was deleted"
    for p, data in before.items():
        assert (tmp_path / p).read_bytes() == data, f"{p} was changed"
    assert not list(tmp_path.glob(".*.tmp-*")), "a temp dir was left behind"
    assert "--max_seq_len 0" not in out.stderr


def test_capacity_messages_never_suggest_zero():
    from helpers.engines import make_limits
    from llmc.compiler.memory_plan import kv_cache_blocks, plan_memory
    from llmc.compiler.spec import ModelSpec

    spec = ModelSpec("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=512)
    limits = make_limits(
        max_batch_size=4, max_num_tokens=64, max_seq_len=512, tokens_per_block=16, max_input_len=256
    )
    plan = plan_memory(spec, limits)
    with pytest.raises(CapacityError) as e:
        kv_cache_blocks(plan, 0, 0.9)
    assert "--max_seq_len 0" not in str(e.value) and "no --max_seq_len fits" in str(e.value)
    with pytest.raises(CapacityError) as e:  # 4 blocks = 64 tokens < max_input_len 256
        kv_cache_blocks(plan, 4 * plan.kv_bytes_per_block, 1.0)
    assert "--max_seq_len 64 --max_input_len 64" in str(e.value)
    with pytest.raises(CapacityError) as e:  # 20 blocks = 320 tokens >= max_input_len
        kv_cache_blocks(plan, 20 * plan.kv_bytes_per_block, 1.0)
    assert "rebuild with --max_seq_len 320" in str(e.value)
    need = plan.weight_bytes_total + plan.workspace_bytes
    with pytest.raises(CapacityError) as e:
        plan_memory(spec, limits, device_memory_bytes=need)
    assert "--max_seq_len 0" not in str(e.value) and "no --max_seq_len fits" in str(e.value)


# ---- in-process: the build's own promises -----------------------------------------------------
def _config(ckpt: Path, out: Path, **fields: object):
    return tiny_build_config(ckpt, **{**SMALL_LIMITS, **fields}).replace(output_dir=str(out))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _marked(d: Path, **marker: object) -> Path:
    import socket

    from llmc.compiler.output_dir import TMP_MARKER

    d.mkdir()
    (d / "weights.safetensors").write_bytes(b"x" * 1000)
    (d / TMP_MARKER).write_text(json.dumps({"host": socket.gethostname(), **marker}))
    return d


def test_stale_temp_dirs_are_cleaned_and_reported(tiny_llama_dir, tmp_path):
    import io
    import time

    from rich.console import Console

    from llmc.cli.build_report import print_report
    from llmc.compiler.builder import build

    stale = _marked(tmp_path / ".engine.tmp-killed", pid=_dead_pid())
    other_host = _marked(tmp_path / ".other.tmp-old", pid=1, created_unix=time.time() - 3 * 86400)
    (other_host / ".llmc-tmp.json").write_text(
        json.dumps({"host": "elsewhere", "pid": 1, "created_unix": time.time() - 3 * 86400})
    )
    live = _marked(tmp_path / ".engine.tmp-running", pid=os.getpid())
    recent = _marked(tmp_path / ".x.tmp-recent", pid=1)
    (recent / ".llmc-tmp.json").write_text(
        json.dumps({"host": "elsewhere", "pid": 1, "created_unix": time.time()})
    )
    foreign = tmp_path / ".data.tmp-mine"  # no marker: not llmc's
    foreign.mkdir()
    result = build(_config(tiny_llama_dir, tmp_path / "engine"))
    assert sorted(result.cleaned) == sorted([str(stale), str(other_host)])
    assert not stale.exists() and not other_host.exists()
    assert live.exists() and recent.exists() and foreign.exists()
    assert result.to_dict()["cleaned_temp_dirs"] == list(result.cleaned)
    buf = io.StringIO()
    print_report(Console(file=buf, width=200), result)
    assert "cleaned" in buf.getvalue() and ".engine.tmp-killed" in buf.getvalue()


def test_a_killed_build_is_cleaned_by_the_next(tiny_llama_dir, tmp_path):
    """kill -9 in the middle of a build leaves its temp dir; the next build removes it."""
    script = (
        "import os, signal, sys\n"
        "from llmc.compiler import builder\n"
        "from llmc.compiler.build_config import BuildConfig\n"
        "def die(*a, **k): os.kill(os.getpid(), signal.SIGKILL)\n"
        "builder.write_engine_files = die\n"
        f"builder.build(BuildConfig(checkpoint_dir={str(tiny_llama_dir)!r}, "
        f"output_dir={str(tmp_path / 'engine')!r}, dtype='float32', target='cpu', "
        "max_seq_len=128, max_num_tokens=64))\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    subprocess.run([sys.executable, "-c", script], timeout=120, env=env, capture_output=True)
    left = list(tmp_path.glob(".engine.tmp-*"))
    assert len(left) == 1
    from llmc.compiler.builder import build

    result = build(_config(tiny_llama_dir, tmp_path / "engine"))
    assert result.cleaned == (str(left[0]),) and not left[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("mkdtemp", PermissionError(errno.EACCES, "Permission denied")),
        ("mkdtemp", OSError(errno.EROFS, "Read-only file system")),
        ("write", OSError(errno.ENOSPC, "No space left on device")),
        ("write", OSError(None, "No space left on device (os error 28)")),  # safetensors (Rust)
        ("write", OSError(errno.EDQUOT, "Disk quota exceeded")),
    ],
    ids=["EACCES", "EROFS", "ENOSPC", "ENOSPC-rust", "EDQUOT"],
)
def test_unwritable_output_is_a_config_error(tiny_llama_dir, tmp_path, monkeypatch, where, error):
    from llmc.compiler import builder, output_dir

    events = []

    def fail(*a, **k):
        raise error

    if where == "mkdtemp":
        monkeypatch.setattr(output_dir.tempfile, "mkdtemp", fail)
    else:
        monkeypatch.setattr(builder, "write_engine_files", fail)
    out = tmp_path / "engine"
    with pytest.raises(ConfigError, match=f"cannot write to '{out}'") as e:
        builder.build(_config(tiny_llama_dir, out), events.append)
    assert e.value.exit_code == 3
    if where == "mkdtemp":  # found before any weight is read
        assert "convert" not in {ev.phase for ev in events}
    assert list(tmp_path.iterdir()) == []


def test_too_little_space_is_refused_before_convert(tiny_llama_dir, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from llmc.compiler import builder, output_dir

    monkeypatch.setattr(output_dir.shutil, "disk_usage", lambda p: SimpleNamespace(free=1))
    events = []
    with pytest.raises(ConfigError, match="needs about .* GiB, its filesystem has"):
        builder.build(_config(tiny_llama_dir, tmp_path / "engine"), events.append)
    assert "convert" not in {ev.phase for ev in events}
    assert list(tmp_path.iterdir()) == []


def test_a_progress_callback_that_raises_leaves_no_half_result(tiny_llama_dir, tmp_path):
    """Every event comes before the commit: a callback that raises aborts the build, and
    build() never raises over a complete engine (nor replaces the old one)."""
    from llmc.compiler.builder import build
    from llmc.compiler.engine_format import load_engine

    out = tmp_path / "engine"
    events = []

    def boom(ev):
        events.append(ev)
        if (ev.phase, ev.status) == ("write", "done"):
            raise RuntimeError("display closed")

    with pytest.raises(RuntimeError, match="display closed"):
        build(_config(tiny_llama_dir, out), boom)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    build(_config(tiny_llama_dir, out, max_batch_size=4))
    with pytest.raises(RuntimeError):
        build(_config(tiny_llama_dir, out, force=True), boom)
    assert load_engine(out).limits.max_batch_size == 4  # the old engine is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    result = build(_config(tiny_llama_dir, out, force=True), events.append)
    assert (events[-1].phase, events[-1].status) == ("write", "done")
    assert load_engine(result.output_dir).limits.max_batch_size == SMALL_LIMITS["max_batch_size"]
