import pytest

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
