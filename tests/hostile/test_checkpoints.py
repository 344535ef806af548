"""Hostile HF checkpoint directories: sizes past the limits, malformed config.json values and
side files (index, generation config, tokenizer files), and values that would build engines
that never run or only emit garbage.

Most cases are a config.json alone, run through ``llmc build --dry_run`` (the build reads the
config, generation_config.json and plans; refused there, nothing proportional to a size has
been allocated). Cases about the weights' index or the tokenizer run a real CPU build on a copy
of the tiny checkpoint, since only a build reads those files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import TINY_LLAMA
from helpers.hostile import Case, run_case
from llmc.compiler import input_bounds as B

CONFIG = {"architectures": ["LlamaForCausalLM"], **TINY_LLAMA}
"""The tiny llama of tests/helpers/checkpoints.py, as its config.json says."""

Setup = Callable[[Path, Path], Path]
"""(tmp_path, the tiny checkpoint) → the checkpoint directory of the case."""


def config(**changes: Any) -> Setup:
    """A directory with CONFIG + ``changes`` (a value None drops the key) as config.json."""

    def setup(tmp: Path, _tiny: Path) -> Path:
        cfg = {k: v for k, v in {**CONFIG, **changes}.items() if v is not None}
        (tmp / "ckpt").mkdir()
        (tmp / "ckpt" / "config.json").write_text(json.dumps(cfg))  # NaN/Infinity as JS does
        return tmp / "ckpt"

    return setup


def files(base: Setup | None = None, **contents: str | bytes) -> Setup:
    """``base`` (default: a copy of the tiny checkpoint) with files written over it (names
    spell dots as ``__``)."""

    def setup(tmp: Path, tiny: Path) -> Path:
        if base is None:
            d = Path(shutil.copytree(tiny, tmp / "ckpt"))
        else:
            d = base(tmp, tiny)
        for name, data in contents.items():
            path = d / name.replace("__", ".")
            path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return d

    return setup


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


DRY = ["build", "--checkpoint_dir", "{ckpt}", "--dry_run", "--target", "cpu"]
BUILD = ["build", "--checkpoint_dir", "{ckpt}", "--output_dir", "{tmp}/engine", "--target",
         "cpu", "--dtype", "float32"]  # fmt: skip
INDEX = "model__safetensors__index__json"
LIM = str

CASES: list[tuple[Case, Setup]] = [
    # ---- sizes past the limits, refused before any loop or allocation (issue item 5) -------
    (
        Case(
            "num_hidden_layers 1e9", DRY, 4, ["num_hidden_layers", LIM(B.MAX_LAYERS)], timeout_s=30
        ),
        config(num_hidden_layers=1e9),
    ),
    (
        Case("hidden_size 2**40", DRY, 4, ["hidden_size", LIM(B.MAX_HIDDEN_SIZE)]),
        config(hidden_size=2**40),
    ),
    (
        Case("intermediate_size 1e12", DRY, 4, ["intermediate_size", LIM(B.MAX_INTERMEDIATE_SIZE)]),
        config(intermediate_size=10**12),
    ),
    (
        Case("vocab_size 1e10", DRY, 4, ["vocab_size", LIM(B.MAX_VOCAB_SIZE)]),
        config(vocab_size=10**10),
    ),
    (
        Case("num_attention_heads 1e6", DRY, 4, ["num_attention_heads", LIM(B.MAX_HEADS)]),
        config(num_attention_heads=10**6, num_key_value_heads=10**6),
    ),
    (
        Case("num_key_value_heads 1e9", DRY, 4, ["num_key_value_heads"]),
        config(num_key_value_heads=10**9),
    ),
    (
        Case(
            "max_position_embeddings 1e12",
            DRY,
            4,
            ["max_position_embeddings", LIM(B.MAX_POSITION_EMBEDDINGS)],
        ),
        config(max_position_embeddings=10**12),
    ),
    (
        Case("head_dim 1024 (real, unsupported)", DRY, 5, ["head_dim", LIM(B.MAX_HEAD_DIM)]),
        config(head_dim=1024),
    ),
    (
        Case("every size at its limit: too many parameters", DRY, 4, ["parameters"]),
        config(
            hidden_size=B.MAX_HIDDEN_SIZE,
            intermediate_size=B.MAX_INTERMEDIATE_SIZE,
            num_hidden_layers=B.MAX_LAYERS,
            head_dim=128,
        ),
    ),
    (
        Case(
            "index.json naming 1e5 tensors",
            BUILD,
            4,
            [INDEX.replace("__", "."), LIM(B.MAX_TENSORS)],
        ),
        files(
            config(),
            **{
                INDEX: json.dumps(
                    {"weight_map": {f"t{i}": "a.safetensors" for i in range(B.MAX_TENSORS + 1)}}
                )
            },
        ),
    ),
    # ---- malformed config.json values (issue item 6) ----------------------------------------
    (
        Case("zero attention heads", DRY, 4, ["num_attention_heads", "positive"]),
        config(num_attention_heads=0),
    ),
    (
        Case("zero kv heads", DRY, 4, ["num_key_value_heads", "positive"]),
        config(num_key_value_heads=0),
    ),
    (Case("negative layers", DRY, 4, ["num_hidden_layers"]), config(num_hidden_layers=-2)),
    (Case("hidden_size a string", DRY, 4, ["hidden_size", "integer"]), config(hidden_size="64")),
    (Case("vocab_size a list", DRY, 4, ["vocab_size"]), config(vocab_size=[256])),
    (
        Case("num_hidden_layers 2.5", DRY, 4, ["num_hidden_layers", "2.5"]),
        config(num_hidden_layers=2.5),
    ),
    (Case("num_hidden_layers true", DRY, 4, ["num_hidden_layers"]), config(num_hidden_layers=True)),
    (Case("hidden_size missing", DRY, 4, ["hidden_size"]), config(hidden_size=None)),
    (
        Case("hidden not a multiple of heads", DRY, 4, ["hidden_size", "num_attention_heads"]),
        config(hidden_size=66),
    ),
    (Case("rope_scaling a string", DRY, 4, ["rope_scaling"]), config(rope_scaling="llama3")),
    (
        Case("rope_scaling without factor", DRY, 4, ["rope_scaling", "factor"]),
        config(rope_scaling={"rope_type": "llama3"}),
    ),
    (
        Case("rope_scaling factor a string", DRY, 4, ["rope_scaling.factor"]),
        config(rope_scaling={"rope_type": "linear", "factor": "2x"}),
    ),
    (
        Case("rope_scaling factor NaN", DRY, 4, ["rope_scaling.factor", "finite"]),
        config(rope_scaling={"rope_type": "linear", "factor": float("nan")}),
    ),
    (
        Case("rope_scaling factor 0", DRY, 4, ["rope_scaling.factor"]),
        config(rope_scaling={"rope_type": "linear", "factor": 0}),
    ),
    (
        Case("rope_scaling high <= low freq factor", DRY, 4, ["high_freq_factor"]),
        config(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8,
                "low_freq_factor": 4,
                "high_freq_factor": 4,
            }
        ),
    ),
    (
        Case("rope_scaling type yarn (unsupported)", DRY, 5, ["yarn"]),
        config(rope_scaling={"rope_type": "yarn", "factor": 2}),
    ),
    (
        Case("architectures a string", DRY, 4, ["architectures"]),
        config(architectures="LlamaForCausalLM"),
    ),
    (
        Case("tie_word_embeddings a string", DRY, 4, ["tie_word_embeddings"]),
        config(tie_word_embeddings="false"),
    ),
    (
        Case("mistral sliding_window a string", DRY, 4, ["sliding_window"]),
        config(architectures=["MistralForCausalLM"], sliding_window="4k"),
    ),
    (
        Case("config.json a list", DRY, 4, ["config.json", "object"]),
        files(config(), config__json="[1, 2]"),
    ),
    (
        Case("config.json nested 100000 deep", DRY, 4, ["config.json"]),
        files(config(), config__json=deep_json(100_000)),
    ),
    (
        Case("config.json not UTF-8", DRY, 4, ["config.json"]),
        files(config(), config__json=b'{"a": "\xff"}'),
    ),
    (
        Case("generation_config.json a list", DRY, 4, ["generation_config.json", "object"]),
        files(config(), generation_config__json="[2]"),
    ),
    (
        Case(
            "generation_config.json eos a string",
            DRY,
            4,
            ["generation_config.json", "eos_token_id"],
        ),
        files(config(), generation_config__json='{"eos_token_id": "</s>"}'),
    ),
    (
        Case("generation_config.json not JSON", DRY, 4, ["generation_config.json"]),
        files(config(), generation_config__json="{eos"),
    ),
    (
        Case("index.json a list", BUILD, 4, [INDEX.replace("__", ".")]),
        files(config(), **{INDEX: "[]"}),
    ),
    (
        Case("index.json shard names not strings", BUILD, 4, ["shard"]),
        files(config(), **{INDEX: '{"weight_map": {"a": 1}}'}),
    ),
    (
        Case("index.json shard outside the directory", BUILD, 4, ["shard", "inside"]),
        files(config(), **{INDEX: '{"weight_map": {"a": "../../etc/passwd"}}'}),
    ),
    (
        Case("index.json not JSON", BUILD, 4, [INDEX.replace("__", ".")]),
        files(config(), **{INDEX: "{weight"}),
    ),
    (
        Case("chat_template.jinja not UTF-8", BUILD, 4, ["chat_template.jinja", "UTF-8"]),
        files(
            None,
            chat_template__jinja=b"{{ \xff\xfe }}",
            tokenizer_config__json='{"eos_token": "</s>"}',
        ),
    ),
    (
        Case("tokenizer_config.json not UTF-8", BUILD, 4, ["tokenizer_config.json"]),
        files(None, tokenizer_config__json=b'{"chat_template": "\xff"}'),
    ),
    (
        Case("chat_template a number", BUILD, 4, ["chat_template"]),
        files(None, tokenizer_config__json='{"chat_template": 5}'),
    ),
    # ---- builds that would succeed into engines that never run (issue item 7) --------------
    (
        Case("odd head_dim (derived)", DRY, 5, ["head_dim", "odd"]),
        config(hidden_size=60, num_attention_heads=4),
    ),
    (Case("odd head_dim (given)", DRY, 5, ["head_dim", "odd"]), config(head_dim=15)),
    (
        Case("eos_token_id -1", DRY, 4, ["eos_token_id", "-1", "vocabulary"]),
        config(eos_token_id=-1),
    ),
    (Case("eos_token_id = vocab_size", DRY, 4, ["eos_token_id", "256"]), config(eos_token_id=256)),
    (Case("one eos of a list outside", DRY, 4, ["eos_token_id"]), config(eos_token_id=[2, 9999])),
    (
        Case("generation_config eos outside", DRY, 4, ["eos_token_id", "vocabulary"]),
        files(config(), generation_config__json='{"eos_token_id": 99999}'),
    ),
    (Case("bos_token_id negative", DRY, 4, ["bos_token_id"]), config(bos_token_id=-5)),
    (Case("rope_theta 0", DRY, 4, ["rope_theta", "positive"]), config(rope_theta=0)),
    (Case("rope_theta negative", DRY, 4, ["rope_theta"]), config(rope_theta=-10000.0)),
    (
        Case("rope_theta infinite", DRY, 4, ["rope_theta", "finite"]),
        config(rope_theta=float("inf")),
    ),
    (
        Case("rms_norm_eps NaN", DRY, 4, ["rms_norm_eps", "finite"]),
        config(rms_norm_eps=float("nan")),
    ),
    (Case("rms_norm_eps 0", DRY, 4, ["rms_norm_eps", "positive"]), config(rms_norm_eps=0)),
    (Case("rms_norm_eps a string", DRY, 4, ["rms_norm_eps"]), config(rms_norm_eps="1e-5")),
    (
        Case("tokenizer.json that does not load", BUILD, 4, ["tokenizer.json", "does not load"]),
        files(None, tokenizer__json='{"model": {"type": "NoSuchModel"}}'),
    ),
    (
        Case("tokenizer.json not JSON", BUILD, 4, ["tokenizer.json"]),
        files(None, tokenizer__json="{vocab"),
    ),
    (
        Case("tokenizer.json a list", BUILD, 4, ["tokenizer.json", "object"]),
        files(None, tokenizer__json="[]"),
    ),
]


@pytest.mark.parametrize("case,setup", [pytest.param(c, s, id=c.name) for c, s in CASES])
def test_hostile_checkpoint(case: Case, setup: Setup, tmp_path: Path, tiny_llama_dir) -> None:
    run_case(case, tmp=tmp_path, ckpt=setup(tmp_path, tiny_llama_dir))
    assert not (tmp_path / "engine").exists()  # a refused build writes nothing
