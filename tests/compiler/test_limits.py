"""EngineLimits: validated on construction, lowered (never raised) by a run, one wording per
rule whoever calls it (BuildConfig, resolve_build, the run's lowering)."""

from __future__ import annotations

import json

import pytest

from helpers.engines import make_limits
from llmc.base.errors import ConfigError
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.limits import EngineLimits, check_chunked_prefill
from llmc.compiler.resolve import ResolvedBuild, resolve_build
from llmc.compiler.spec import ModelSpec

BUILT = make_limits(
    max_batch_size=8, max_input_len=96, max_seq_len=128, max_num_tokens=128, tokens_per_block=16
)


def _rule_message(max_num_tokens: int, max_input_len: int) -> str:
    with pytest.raises(ConfigError) as e:
        check_chunked_prefill(max_num_tokens, max_input_len, False)
    return str(e.value)


def test_lowered_keeps_what_is_not_given_and_lowers_what_is():
    assert BUILT.lowered() == BUILT
    low = BUILT.lowered(max_batch_size=2, max_num_tokens=32, enable_chunked_prefill=True)
    assert (low.max_batch_size, low.max_num_tokens) == (2, 32)
    assert (low.max_seq_len, low.max_input_len, low.tokens_per_block) == (128, 96, 16)
    assert BUILT.lowered(enable_chunked_prefill=False).max_num_tokens == 128


@pytest.mark.parametrize(("name", "asked"), [("max_batch_size", 9), ("max_num_tokens", 256)])
def test_raising_a_limit_names_both_values_and_the_rebuild_flag(name, asked):
    with pytest.raises(ConfigError) as e:
        BUILT.lowered(**{name: asked})
    built = getattr(BUILT, name)
    msg = str(e.value)
    assert f"{name}={asked} exceeds the engine's {name}={built}" in msg
    assert f"--{name} {asked}" in msg


def test_limits_are_validated_on_construction():
    with pytest.raises(ConfigError, match="max_num_tokens must be a positive integer, got 0"):
        BUILT.lowered(max_num_tokens=0)
    with pytest.raises(ConfigError, match=r"max_input_len \(200\) must not exceed"):
        EngineLimits(**{**BUILT.to_dict(), "max_input_len": 200})
    with pytest.raises(ConfigError, match="dtype 'float8'"):
        EngineLimits(**{**BUILT.to_dict(), "dtype": "float8"})
    assert BUILT.max_blocks_per_seq == 8


def test_chunked_prefill_rule_has_one_wording_for_every_caller(tiny_llama_dir):
    """BuildConfig (flags given), resolve_build (max_input_len derived from the model) and a
    run turning chunked prefill off with a small budget raise the same ConfigError."""
    want = _rule_message(64, 96)
    assert "max_num_tokens (64)" in want and "max_input_len (96)" in want
    assert "raise max_num_tokens to 96 or enable chunked prefill" in want
    with pytest.raises(ConfigError) as e:
        BuildConfig(max_input_len=96, max_num_tokens=64, enable_chunked_prefill=False)
    assert str(e.value) == want
    spec = ModelSpec.from_hf_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    config = BuildConfig(max_seq_len=96, max_num_tokens=64, enable_chunked_prefill=False)
    with pytest.raises(ConfigError) as e:
        resolve_build(config, spec, None)  # max_input_len = max_seq_len = 96, derived
    assert str(e.value) == want
    with pytest.raises(ConfigError) as e:
        BUILT.lowered(max_num_tokens=64, enable_chunked_prefill=False)
    assert str(e.value) == want


def test_manifest_build_section_stays_flat():
    build = ResolvedBuild(BUILT, target="cpu", load_format="dummy", dummy_seed=3)
    d = json.loads(json.dumps(build.to_dict()))
    assert d["max_num_tokens"] == 128 and d["target"] == "cpu" and "limits" not in d
    assert ResolvedBuild.from_dict(d) == build
