"""``llmc.compiler.builder.build``: round trips, atomicity, dummy weights, capacity, dry run."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from safetensors.torch import load_file

import llmc
from llmc.base.errors import CapacityError, ConfigError
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build
from llmc.compiler.engine_format import load_engine
from llmc.compiler.spec import ModelSpec
from llmc.compiler.weight_passes import to_engine_weights


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Plan as on a machine without GPU, so that --gpu_memory_gb decides (also on the H200)."""
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


@pytest.mark.parametrize(
    ("fixture", "dtype"),
    [("tiny_llama_dir", "float32"), ("tiny_llama_dir", "bfloat16"), ("tiny_qwen2_dir", "float16")],
)
def test_round_trip_is_bit_exact(request, tmp_path, fixture, dtype):
    ckpt = request.getfixturevalue(fixture)
    out = tmp_path / "engine"
    events = []
    result = build(
        BuildConfig(checkpoint_dir=str(ckpt), output_dir=str(out), dtype=dtype),
        events.append,
    )
    assert [e.phase for e in events if e.status == "start"] == list(builder.PHASES)
    assert result.output_dir == out and not result.dry_run

    engine = load_engine(out)
    hf_config = json.loads((ckpt / "config.json").read_text())
    spec = ModelSpec.from_hf_config(hf_config)
    assert engine.spec.num_layers == spec.num_layers and engine.spec.qkv_bias == spec.qkv_bias
    expected = to_engine_weights(spec, load_file(ckpt / "model.safetensors"), dtype)
    got = engine.load_weights("cpu")
    assert set(got) == set(expected) == set(spec.tensor_shapes())
    for name, t in expected.items():
        assert got[name].dtype == t.dtype
        assert torch.equal(_bits(got[name]), _bits(t)), name
    if spec.qkv_bias:
        assert "layers.0.qkv_bias" in got

    m = engine.manifest
    assert m["format_version"] == llmc.ENGINE_FORMAT_VERSION
    assert m["llmc_version"] == llmc.__version__
    assert m["build"]["dtype"] == dtype and m["build"]["target"] == "cpu"
    assert m["kernels"] == {"arch": None, "files": []}
    assert {"weights.safetensors", "plan.json", "tokenizer.json"} <= set(m["files"])
    for name, digest in m["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert engine.tokenizer_path == out / "tokenizer.json"
    assert engine.plan == result.plan
    assert engine.limits.max_seq_len == spec.max_position_embeddings  # derived default


def test_defaults_are_derived_and_reported(tiny_llama_dir, tmp_path):
    result = build(BuildConfig(checkpoint_dir=str(tiny_llama_dir)), dry_run=True)
    assert result.build.limits.max_seq_len == 512 and result.build.limits.max_input_len == 512
    assert result.build.target == "cpu"
    assert any("max_seq_len = 512" in n for n in result.notes)
    assert any("target = cpu" in n for n in result.notes)
    assert result.plan.capacity is None
    assert any("no --gpu_memory_gb" in n for n in result.plan.notes)


def test_max_seq_len_beyond_the_model_is_refused(tiny_llama_dir):
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        build(BuildConfig(checkpoint_dir=str(tiny_llama_dir), max_seq_len=1024), dry_run=True)


def test_dry_run_writes_nothing(tiny_llama_dir, tmp_path):
    out = tmp_path / "engine"
    result = build(
        BuildConfig(checkpoint_dir=str(tiny_llama_dir), output_dir=str(out)), dry_run=True
    )
    assert result.dry_run and result.output_dir is None
    assert list(tmp_path.iterdir()) == []


def test_failed_build_leaves_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    real = builder.write_engine_files

    def write_then_fail(tmp_dir, *args, **kwargs):
        real(tmp_dir, *args, **kwargs)  # everything is written, then the last step fails
        raise OSError("disk full")

    monkeypatch.setattr(builder, "write_engine_files", write_then_fail)
    out = tmp_path / "engine"
    with pytest.raises(OSError, match="disk full"):
        build(BuildConfig(checkpoint_dir=str(tiny_llama_dir), output_dir=str(out)))
    assert list(tmp_path.iterdir()) == []


def test_existing_output_dir_needs_force(tiny_llama_dir, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "old.txt").write_text("old")
    cfg = BuildConfig(checkpoint_dir=str(tiny_llama_dir), output_dir=str(out))
    with pytest.raises(ConfigError, match="already exists.*--force"):
        build(cfg)
    assert (out / "old.txt").exists()
    # --force replaces an llmc engine (or an empty directory), never unrelated files
    with pytest.raises(ConfigError, match="is not an llmc engine"):
        build(cfg.replace(force=True))
    assert (out / "old.txt").read_text() == "old"
    (out / "old.txt").unlink()
    build(cfg.replace(force=True))  # empty
    (out / "old.txt").write_text("old")  # an engine with an extra file is still an engine
    build(cfg.replace(force=True))
    assert not (out / "old.txt").exists() and (out / "manifest.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_dummy_build_stores_the_seed(tmp_path):
    from llmc.compiler.dummy import dummy_weights

    out = tmp_path / "engine"
    cfg = BuildConfig(
        output_dir=str(out), load_format="dummy", dummy_seed=7, dtype="float32", max_seq_len=256
    )
    model = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    build(cfg, model_config=model)
    assert not (out / "weights.safetensors").exists()
    engine = load_engine(out)
    assert engine.build.load_format == "dummy" and engine.build.dummy_seed == 7
    assert engine.tokenizer_path is None
    got = engine.load_weights("cpu")
    want = dummy_weights(engine.spec, "float32", 7, "cpu")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_capacity_error_before_any_weight_is_read(tiny_llama_dir, monkeypatch):
    import llmc.compiler.checkpoint as checkpoint

    def no_weights(path):
        raise AssertionError("weights were read before the capacity check")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_weights)
    cfg = BuildConfig(checkpoint_dir=str(tiny_llama_dir), max_num_tokens=256, max_batch_size=4)
    plan = build(cfg, dry_run=True).plan
    # room for the weights, the workspace and half of one max_seq_len request's KV cache
    half = plan.blocks_per_max_seq * plan.kv_bytes_per_block // 2
    gib = (plan.weight_bytes_total + plan.workspace_bytes + half) / (1 << 30)
    with pytest.raises(CapacityError, match="max_seq_len=512.*--max_seq_len 2"):
        build(cfg.replace(gpu_memory_gb=gib))


def test_smollm2_gguf_builds_in_under_a_minute(smollm2_gguf, tmp_path):
    out = tmp_path / "smollm2"
    t0 = time.perf_counter()
    cfg = BuildConfig(
        checkpoint_dir=str(smollm2_gguf), output_dir=str(out), max_seq_len=2048, max_num_tokens=2048
    )
    result = build(cfg)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"SmolLM2 build took {elapsed:.1f} s"
    engine = load_engine(out)
    assert engine.spec.num_layers == 30 and engine.spec.tie_word_embeddings
    assert engine.manifest["source"]["format"] == "gguf"
    # the default keeps the file's Q4_1 / Q8_0 blocks (bf16 would be num_parameters() * 2)
    assert engine.limits.quantization == "gguf" and len(engine.layouts) == 1 + 30 * 4
    assert result.plan.weight_bytes_total <= 100_000_000
    assert (out / "tokenizer.json").stat().st_size > 100_000
