import pytest

from helpers.checkpoints import TINY_LLAMA
from llmc.base.errors import ConfigError, UnsupportedError, UsageError
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.spec import ModelSpec


def test_spec_from_tiny_llama(tiny_llama_dir):
    import json

    spec = ModelSpec.from_hf_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    assert spec.num_heads == 4 and spec.num_kv_heads == 2 and spec.head_dim == 16
    assert spec.tensor_shapes()["layers.0.qkv_proj"] == (4 * 16 + 2 * 2 * 16, 64)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelSpec.from_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_build_config_validation():
    with pytest.raises(ConfigError, match="max_input_len"):
        BuildConfig(max_input_len=4096, max_seq_len=2048)
    with pytest.raises(ConfigError, match="max_num_tokens"):
        BuildConfig(max_num_tokens=8, tokens_per_block=32)
    with pytest.raises(UnsupportedError, match="float8"):
        BuildConfig(dtype="float8")
    with pytest.raises(UsageError, match="did you mean 'max_num_tokens'"):
        BuildConfig.from_dict({"max_num_token": 5})
    with pytest.raises(ConfigError, match="max_batch_size"):
        BuildConfig(max_batch_size=0)


# ---- size limits and value checks (compiler/input_bounds.py) ----------------------------
TINY_CFG = {"architectures": ["LlamaForCausalLM"], **TINY_LLAMA}


def test_every_config_size_key_has_a_limit():
    import dataclasses

    from llmc.compiler import input_bounds as B

    assert set(B.HF_CONFIG_KEYS.values()) == set(B.MODEL_SIZE_LIMITS)
    assert set(B.MODEL_SIZE_LIMITS) <= {f.name for f in dataclasses.fields(ModelSpec)}


def test_a_size_past_its_limit_fails_before_any_loop():
    import time

    from llmc.base.errors import CheckpointError
    from llmc.compiler.input_bounds import MAX_LAYERS

    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"num_hidden_layers = 1000000000 .*{MAX_LAYERS}"):
        ModelSpec.from_hf_config({**TINY_CFG, "num_hidden_layers": 1e9}, "c.json")
    with pytest.raises(CheckpointError, match=f"num_layers = 1000000000 .*{MAX_LAYERS}"):
        ModelSpec("LlamaForCausalLM", 256, 64, 160, 10**9, 4, 2, 16)
    assert time.perf_counter() - t0 < 0.5


def test_the_limit_at_its_value_is_accepted():
    from llmc.compiler.input_bounds import MAX_HEAD_DIM, MAX_LAYERS

    spec = ModelSpec.from_hf_config({**TINY_CFG, "num_hidden_layers": MAX_LAYERS})
    assert spec.num_layers == MAX_LAYERS
    cfg = {**TINY_CFG, "hidden_size": 4 * MAX_HEAD_DIM}
    assert ModelSpec.from_hf_config(cfg).head_dim == MAX_HEAD_DIM
    with pytest.raises(UnsupportedError, match="head_dim"):
        ModelSpec.from_hf_config({**TINY_CFG, "head_dim": MAX_HEAD_DIM + 2})


@pytest.mark.parametrize(
    "change,error,message",
    [
        ({"num_attention_heads": 0}, "CheckpointError", "num_attention_heads must be a positive"),
        ({"hidden_size": "64"}, "CheckpointError", "hidden_size must be an integer, got '64'"),
        ({"num_hidden_layers": 2.0}, None, ""),  # an integral JSON float is an integer
        ({"num_hidden_layers": 2.5}, "CheckpointError", "num_hidden_layers must be an integer"),
        ({"rope_scaling": [1]}, "CheckpointError", "rope_scaling must be a mapping"),
        ({"rope_scaling": {"type": "linear"}}, "CheckpointError", "lacks 'factor'"),
        ({"head_dim": 15}, "UnsupportedError", "head_dim 15 is odd"),
        ({"eos_token_id": -1}, "CheckpointError", "eos_token_id -1 is outside the vocabulary"),
        ({"bos_token_id": 256}, "CheckpointError", "bos_token_id 256 is outside"),
        ({"rope_theta": 0}, "CheckpointError", "rope_theta must be positive"),
        ({"rms_norm_eps": float("nan")}, "CheckpointError", "rms_norm_eps must be a finite"),
        ({"tie_word_embeddings": "no"}, "CheckpointError", "tie_word_embeddings must be true"),
    ],
)
def test_config_values_are_typed_and_checked(change, error, message):
    import llmc.base.errors as errors

    if error is None:
        ModelSpec.from_hf_config({**TINY_CFG, **change})
        return
    with pytest.raises(getattr(errors, error), match=message):
        ModelSpec.from_hf_config({**TINY_CFG, **change})


def test_from_dict_of_a_broken_spec_is_a_config_error():
    spec = ModelSpec.from_hf_config(TINY_CFG).to_dict()
    with pytest.raises(ConfigError, match="model spec"):
        ModelSpec.from_dict({**spec, "rope_scaling": {"nope": 1}})
    del spec["vocab_size"]
    with pytest.raises(ConfigError, match="model spec"):
        ModelSpec.from_dict(spec)


def test_build_config_fields_are_typed():
    with pytest.raises(ConfigError, match="gpu_memory_gb must be a finite number or null, got nan"):
        BuildConfig(gpu_memory_gb=float("nan"))
    with pytest.raises(ConfigError, match="max_batch_size must be an integer, got \\[1\\]"):
        BuildConfig(max_batch_size=[1])
    with pytest.raises(ConfigError, match="force must be true/false"):
        BuildConfig(force="yes")
    assert BuildConfig(gpu_memory_gb=80).gpu_memory_gb == 80  # an int is a number


def test_yaml_expansion_is_bounded(tmp_path):
    from llmc.compiler.input_bounds import MAX_YAML_VALUES, load_yaml

    lines = ['l0: &l0 "lol"'] + [
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)
    ]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines))
    with pytest.raises(UsageError, match=f"bomb.yaml: expands to more than {MAX_YAML_VALUES}"):
        load_yaml(tmp_path / "bomb.yaml", str(tmp_path / "bomb.yaml"))
    (tmp_path / "latin1.yaml").write_bytes(b"a: caf\xe9")
    with pytest.raises(UsageError, match="not UTF-8"):
        load_yaml(tmp_path / "latin1.yaml", "latin1.yaml")
