"""load_engine refuses every broken engine with an EngineError naming the problem."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

import llmc
from llmc.base.errors import EngineError
from llmc.compiler.engine_format import load_engine, rebuild_command
from llmc.compiler.memory_plan import MemoryPlan


@pytest.fixture(scope="module")
def engine_dir(tiny_engine, tiny_llama_dir):
    # shared: the tests that break a file take engine_copy; the rebuild command names these
    return tiny_engine(tiny_llama_dir, max_seq_len=256, max_num_tokens=128, max_batch_size=8)


@pytest.fixture
def engine_copy(engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine_dir, dst)
    return dst


def _edit_manifest(d, **changes):
    m = json.loads((d / "manifest.json").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            m[section][field] = value
        else:
            m[section] = value
    (d / "manifest.json").write_text(json.dumps(m))


def test_loads_a_good_engine(engine_dir):
    e = load_engine(engine_dir, target="cpu")
    assert e.limits.max_seq_len == 256 and e.limits.max_num_tokens == 128
    assert e.build.load_format == "auto" and e.build.dummy_seed is None
    assert isinstance(e.plan, MemoryPlan) and e.plan.limits == e.limits
    assert e.kernels_dir == engine_dir / "kernels" and e.kernel_files == ()
    assert set(e.load_weights("cpu")) == set(e.spec.tensor_shapes())


def test_missing_directory(tmp_path):
    with pytest.raises(EngineError, match="does not exist.*llmc build"):
        load_engine(tmp_path / "nope")


@pytest.mark.parametrize("name", ["weights.safetensors", "plan.json", "tokenizer.json"])
def test_missing_file_is_named(engine_copy, name):
    (engine_copy / name).unlink()
    with pytest.raises(EngineError, match=f"{name} is missing"):
        load_engine(engine_copy)


def test_missing_manifest(engine_copy):
    (engine_copy / "manifest.json").unlink()
    with pytest.raises(EngineError, match="manifest.json.*missing"):
        load_engine(engine_copy)


@pytest.mark.parametrize("name", ["weights.safetensors", "tokenizer.json", "plan.json"])
def test_tampered_file_is_named(engine_copy, name):
    data = bytearray((engine_copy / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (engine_copy / name).write_bytes(bytes(data))
    with pytest.raises(EngineError, match=f"{name} is corrupt: sha256") as e:
        load_engine(engine_copy)
    assert "llmc build --checkpoint_dir" in str(e.value)
    if name != "plan.json":
        load_engine(engine_copy, verify_checksums=False)  # opt-out skips hashing
        return
    # hashing skipped, a plan.json is still checked against this llmc's plan
    with pytest.raises(EngineError, match="plan.json") as e:
        load_engine(engine_copy, verify_checksums=False)
    assert "corrupt: sha256" not in str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [("llmc_version", "0.0.1", "0.0.1"), ("format_version", 999, "999")],
)
def test_version_mismatch_names_both_values_and_rebuild(engine_copy, key, value, shown):
    _edit_manifest(engine_copy, **{key: value})
    with pytest.raises(EngineError) as e:
        load_engine(engine_copy)
    msg = str(e.value)
    assert shown in msg and llmc.__version__ in msg and str(llmc.ENGINE_FORMAT_VERSION) in msg
    assert "llmc build --checkpoint_dir" in msg and "--max_seq_len 256" in msg and "--force" in msg


def test_target_rules(engine_copy):
    # a cpu engine runs anywhere through the torch backend, not on the CUDA backend
    load_engine(engine_copy, target="cpu")
    with pytest.raises(EngineError, match=r"built for target 'cpu'.*needs 'sm_90'.*--target sm_90"):
        load_engine(engine_copy, target="sm_90")
    # an sm_90 engine runs on sm_90 (CUDA backend) or through torch, not on another arch
    _edit_manifest(engine_copy, build__target="sm_90")
    load_engine(engine_copy, target="sm_90")
    load_engine(engine_copy, target="cpu")
    with pytest.raises(EngineError, match=r"'sm_90'.*needs 'sm_80'.*--target sm_80"):
        load_engine(engine_copy, target="sm_80")


def test_malformed_manifest(engine_copy):
    (engine_copy / "manifest.json").write_text("{not json")
    with pytest.raises(EngineError, match="manifest.json.*not valid JSON"):
        load_engine(engine_copy)
    bare = {"format_version": llmc.ENGINE_FORMAT_VERSION, "llmc_version": llmc.__version__}
    (engine_copy / "manifest.json").write_text(json.dumps(bare))
    with pytest.raises(EngineError, match="files"):
        load_engine(engine_copy)


def test_wrong_weights_are_refused_at_load(engine_copy):
    import hashlib

    import torch
    from safetensors.torch import save_file

    save_file({"embed_tokens": torch.zeros(3, 3)}, engine_copy / "weights.safetensors")
    digest = hashlib.sha256((engine_copy / "weights.safetensors").read_bytes()).hexdigest()
    m = json.loads((engine_copy / "manifest.json").read_text())
    m["files"]["weights.safetensors"] = digest
    (engine_copy / "manifest.json").write_text(json.dumps(m))
    engine = load_engine(engine_copy)
    with pytest.raises(EngineError, match="tensor .layers.0.input_norm. is missing"):
        engine.load_weights("cpu")


def test_rebuild_command_carries_non_default_settings(engine_dir):
    m = json.loads((engine_dir / "manifest.json").read_text())
    cmd = rebuild_command(m, engine_dir, target="sm_90")
    assert cmd.startswith("llmc build --checkpoint_dir ")
    for part in ("--dtype float32", "--max_seq_len 256", "--max_num_tokens 128", "--target sm_90"):
        assert part in cmd
    assert "--max_batch_size 8" in cmd and cmd.endswith("--force")


def _rewrite_plan(d, edit) -> None:
    """Edit plan.json and record its new checksum, as a consistent (not corrupt) engine."""
    plan = json.loads((d / "plan.json").read_text())
    edit(plan)
    (d / "plan.json").write_text(json.dumps(plan))
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["plan.json"] = hashlib.sha256((d / "plan.json").read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))


def test_plan_that_is_not_this_llmcs_plan_is_refused(engine_copy):
    def alias(plan):  # gate_up onto act's bytes, while both are live at silu_mul
        bufs = {b["name"]: b for b in plan["buffers"]}
        bufs["gate_up"]["offset"] = bufs["act"]["offset"]

    _rewrite_plan(engine_copy, alias)
    with pytest.raises(EngineError, match="not this llmc's memory plan.*'gate_up'") as e:
        load_engine(engine_copy)
    assert "llmc build --checkpoint_dir" in str(e.value)


def test_plan_for_other_limits_than_the_manifest_is_refused(engine_copy):
    _rewrite_plan(engine_copy, lambda plan: plan["limits"].update(max_batch_size=4))
    with pytest.raises(EngineError, match="plan.json was planned for .*max_batch_size=4"):
        load_engine(engine_copy)


def test_printable_escapes_control_characters_only():
    from llmc.base.text import printable

    assert printable("a\x1b[31mb\x07\r\x9b\u202e") == "a\\x1b[31mb\\x07\\x0d\\x9b\\u202e"
    assert printable("plain text\twith a tab\nand a newline, é ü 中") == (
        "plain text\twith a tab\nand a newline, é ü 中"
    )
    assert printable(5) == "5"


def test_rebuild_command_escapes_the_manifest(engine_dir):
    m = json.loads((engine_dir / "manifest.json").read_text())
    m["build_config"]["checkpoint_dir"] = "/x\x1b]0;t\x07"
    cmd = rebuild_command(m, engine_dir)
    assert "\x1b" not in cmd and "\\x1b" in cmd
    assert rebuild_command({"build_config": "x", "source": 5}, engine_dir).startswith("llmc build")


def test_an_engine_dir_reached_through_a_symlink_loads(engine_dir, tmp_path):
    (tmp_path / "link").symlink_to(engine_dir)
    assert load_engine(tmp_path / "link").limits.max_seq_len == 256


def test_a_file_outside_is_refused_unopened_with_its_digest(engine_copy, tmp_path, monkeypatch):
    import builtins
    from pathlib import Path

    secret = tmp_path / "secret"
    secret.write_text("not the engine's")
    m = json.loads((engine_copy / "manifest.json").read_text())
    m["files"][str(secret)] = hashlib.sha256(secret.read_bytes()).hexdigest()
    (engine_copy / "manifest.json").write_text(json.dumps(m))
    opened = []
    real_open, real_path_open = builtins.open, Path.open

    def spy(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    def path_spy(self, *a, **k):
        opened.append(str(self))
        return real_path_open(self, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(Path, "open", path_spy)
    with pytest.raises(EngineError, match="not a relative path inside the engine") as e:
        load_engine(engine_copy)
    assert not any("secret" in p for p in opened)
    assert hashlib.sha256(secret.read_bytes()).hexdigest()[:8] not in str(e.value)


def test_a_format_2_engine_without_an_fp8_kv_cache_still_loads(engine_copy):
    """Format 3 only added an fp8 KV cache's k_mean tensors: an engine of format 2 without
    that cache is the same directory and loads as it is."""
    assert llmc.ENGINE_FORMAT_VERSION == 3
    _edit_manifest(engine_copy, format_version=2)
    e = load_engine(engine_copy, target="cpu")
    assert e.manifest["format_version"] == 2 and e.limits.kv_cache_dtype == "auto"
