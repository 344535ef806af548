"""HF checkpoint directories → Checkpoint: round trip, shards, tokenizer files, bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.checkpoint import Checkpoint, load_checkpoint, read_model_spec
from llmc.compiler.spec import ModelSpec


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shard(model_dir: Path, num_shards: int) -> dict[str, torch.Tensor]:
    """Split model.safetensors into ``num_shards`` files + index (as save_pretrained would)."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, model_dir / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_round_trip_matches_transformers(fixture, request):
    import transformers

    model_dir = request.getfixturevalue(fixture)
    ckpt = load_checkpoint(model_dir)
    assert isinstance(ckpt, Checkpoint) and ckpt.source_format == "hf"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert ckpt.hf_config == cfg
    assert ckpt.spec == ModelSpec.from_hf_config(cfg)
    assert read_model_spec(model_dir) == (ckpt.spec, cfg)

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(ckpt.tensors) == set(ref)
    for name, t in ckpt.tensors.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name
    assert ckpt.spec.qkv_bias == (fixture == "tiny_qwen2_dir")


def test_tokenizer_files(tiny_llama_dir):
    files = load_checkpoint(tiny_llama_dir).tokenizer_files
    assert files["tokenizer.json"] == (tiny_llama_dir / "tokenizer.json").read_bytes()
    tok_cfg = json.loads(files["tokenizer_config.json"])
    assert tok_cfg["bos_token"] == "<s>" and tok_cfg["eos_token"] == "</s>"
    assert "{% for m in messages %}" in tok_cfg["chat_template"]
    assert "generation_config.json" in files  # save_pretrained writes one


def test_chat_template_jinja_is_folded_into_tokenizer_config(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    template = tok_cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (d / "chat_template.jinja").write_text(template)
    files = load_checkpoint(d).tokenizer_files
    assert json.loads(files["tokenizer_config.json"])["chat_template"] == template


def test_generation_config_eos_ids_join_the_spec(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    spec, cfg = read_model_spec(d)
    assert spec.eos_token_ids == (2, 7) and cfg["eos_token_id"] == 2


@pytest.mark.parametrize("num_shards", [2, 3])
def test_sharded_checkpoint_equals_single_file(tiny_qwen2_dir, tmp_path, num_shards):
    single = load_checkpoint(tiny_qwen2_dir)
    d = _copy(tiny_qwen2_dir, tmp_path / "sharded")
    _shard(d, num_shards)
    assert not (d / "model.safetensors").exists()
    sharded = load_checkpoint(d)
    assert set(sharded.tensors) == set(single.tensors)
    for name, t in single.tensors.items():
        assert torch.equal(sharded.tensors[name], t), name


# ---- bad inputs ---------------------------------------------------------------------------


def test_missing_path_and_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="x.txt"):
        read_model_spec(tmp_path / "x.txt")


def test_missing_config_json(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    for fn in (read_model_spec, load_checkpoint):
        with pytest.raises(CheckpointError, match="config.json is missing"):
            fn(d)


def test_config_json_not_json(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not a valid JSON"):
        read_model_spec(d)


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="GPTNeoXForCausalLM"):
        load_checkpoint(d)


def test_quantized_hf_checkpoint_is_refused(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="gptq"):
        read_model_spec(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors(tiny_llama_dir, tmp_path, damage):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\xff" * 64, "empty": b""}[damage]
    )
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(d)


def test_no_weights_file(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(d)
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedError, match="safetensors"):
        load_checkpoint(d)


def test_index_problems(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    tensors = _shard(d, 2)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    bad = dict(index, weight_map={**index["weight_map"], "extra.weight": "model-9.safetensors"})
    index_path.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="model-9.safetensors.*missing"):
        load_checkpoint(d)

    shard = index["weight_map"]["model.norm.weight"]
    bad = dict(index, weight_map={**index["weight_map"], "ghost.weight": shard})
    index_path.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="'ghost.weight' named in the index"):
        load_checkpoint(d)

    # the same tensor stored in both shards
    index_path.write_text(json.dumps(index))
    other = next(s for s in set(index["weight_map"].values()) if s != shard)
    part = load_file(d / other)
    part["model.norm.weight"] = tensors["model.norm.weight"]
    save_file(part, d / other)
    with pytest.raises(CheckpointError, match="'model.norm.weight' also appears"):
        load_checkpoint(d)


def _rewrite(d: Path, edit) -> None:
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")


def test_missing_unexpected_and_misshaped_tensors(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "missing")
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        load_checkpoint(d)

    d = _copy(tiny_llama_dir, tmp_path / "unexpected")
    _rewrite(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra"):
        load_checkpoint(d)

    d = _copy(tiny_llama_dir, tmp_path / "shape")
    _rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[65\], expected"):
        load_checkpoint(d)


def test_missing_tokenizer(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_checkpoint(d)


def test_index_shards_stay_inside_the_checkpoint(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    for shard in ("../outside.safetensors", "/etc/passwd", 7, ""):
        index_path.write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
        with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
            load_checkpoint(d)


def test_tokenizer_is_loaded_once_at_build(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(CheckpointError, match="tokenizer.json: the tokenizer does not load"):
        load_checkpoint(d)


def test_bad_side_files_are_checkpoint_errors(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text('["eos"]')
    with pytest.raises(CheckpointError, match="generation_config.json: expected a JSON object"):
        read_model_spec(d)
    (d / "generation_config.json").write_text('{"eos_token_id": [2, "x"]}')
    with pytest.raises(CheckpointError, match="eos_token_id must be an integer"):
        read_model_spec(d)
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_bytes(b"{{ \xff }}")
    with pytest.raises(CheckpointError, match="chat_template.jinja: not UTF-8"):
        load_checkpoint(d)
