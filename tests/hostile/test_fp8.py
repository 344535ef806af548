"""Hostile FP8 inputs through ``llmc build`` in a child process: unknown --quantization /
--kv_cache_dtype values (did-you-mean), fp8 for a target without FP8 tensor cores, profile
values of the wrong type, pre-quantized checkpoints whose scales are missing, mis-shaped,
zero, negative or not finite, weights of the wrong fp8 dtype, unknown quantization methods,
and a float weight that is not finite for an fp8 build. Each: its exit code, a message
naming the input, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.fp8_checkpoints import write_fp8_checkpoint
from helpers.hostile import Case, run_case

Setup = Callable[[Path, Path], Path]
"""(tmp_path, the tiny checkpoint) → the checkpoint directory of the case."""

BUILD = ["build", "--checkpoint_dir", "{ckpt}", "--output_dir", "{tmp}/engine", "--target",
         "cpu", "--dtype", "float32", "--max_seq_len", "64"]  # fmt: skip
DRY = ["build", "--checkpoint_dir", "{ckpt}", "--dry_run", "--target", "cpu"]
Q = "model.layers.0.self_attn.q_proj."


def tiny(tmp: Path, ckpt: Path) -> Path:
    return ckpt


def prequantized(layout: str = "fp8-tensor", **tensors: torch.Tensor | None) -> Setup:
    """The tiny checkpoint pre-quantized in ``layout``, with tensors (names spell dots as
    ``__``) replaced (None: removed)."""

    def setup(tmp: Path, ckpt: Path) -> Path:
        def edit(t: dict[str, torch.Tensor]) -> None:
            for name, value in tensors.items():
                key = name.replace("__", ".")
                if value is None:
                    del t[key]
                else:
                    t[key] = value

        return write_fp8_checkpoint(ckpt, tmp / "ckpt", layout, edit=edit)

    return setup


def method(config: dict) -> Setup:
    def setup(tmp: Path, ckpt: Path) -> Path:
        return write_fp8_checkpoint(ckpt, tmp / "ckpt", "ct-tensor", config=config)

    return setup


def nan_weight(tmp: Path, ckpt: Path) -> Path:
    d = Path(shutil.copytree(ckpt, tmp / "ckpt"))
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.mlp.down_proj.weight"][5, 9] = float("nan")
    save_file(t, str(d / "model.safetensors"))
    return d


def bad_profile(tmp: Path, ckpt: Path) -> Path:
    (tmp / "p.yaml").write_text(json.dumps({"build": {"quantization": 8}}))
    return ckpt


S = Q.replace(".", "__") + "weight_scale"
W = Q.replace(".", "__") + "weight"
CASES: list[tuple[Case, Setup]] = [
    (Case("--quantization fp9", [*DRY, "--quantization", "fp9"], 5,
          ["quantization 'fp9' is not supported", "did you mean 'fp8'?"]), tiny),
    (Case("--kv-cache-dtype fp8_e4m3", [*DRY, "--kv-cache-dtype", "fp8_e4m3"], 5,
          ["kv_cache_dtype 'fp8_e4m3'", "did you mean 'fp8'?"]), tiny),
    (Case("fp8 for sm_80", [*DRY[:-2], "--quantization", "fp8", "--target", "sm_80"], 5,
          ["the target is sm_80", "--quantization none"]), tiny),
    (Case("quantization: 8 in a profile", [*DRY[:-2], "--profile", "{tmp}/p.yaml"], 2,
          ["quantization must be a str"]), bad_profile),
    (Case("weight_scale missing", BUILD, 4, [f"{Q}weight_scale' is missing"]),
     prequantized(**{S: None})),
    (Case("weight_scale mis-shaped", BUILD, 4, [f"{Q}weight_scale' has shape [2, 64]"]),
     prequantized(**{S: torch.ones(2, 64)})),
    (Case("weight_scale zero", BUILD, 4, [f"{Q}weight_scale'", "zero, negative or not finite"]),
     prequantized(**{S: torch.tensor(0.0)})),
    (Case("weight_scale negative", BUILD, 4, [f"{Q}weight_scale'", "e.g. -0.5"]),
     prequantized(**{S: torch.tensor(-0.5)})),
    (Case("weight_scale inf (channel)", BUILD, 4, [f"{Q}weight_scale'", "1 scale(s)"]),
     prequantized("ct-channel", **{S: torch.full((64, 1), 0.01).index_fill(0, torch.tensor([3]),
                                                                           float("inf"))})),
    (Case("k_scale negative", BUILD, 4, ["model.layers.1.self_attn.k_scale"]),
     prequantized(**{"model__layers__1__self_attn__k_scale": torch.tensor(-2.0)})),
    (Case("weight e5m2", BUILD, 5, [f"{Q}weight' is float8_e5m2"]),
     prequantized(**{W: torch.zeros(64, 64, dtype=torch.float8_e5m2)})),
    (Case("quant_method awq", DRY, 5, ["quant_method 'awq' is not supported"]),
     method({"quant_method": "awq", "bits": 4})),
    (Case("quant_method typo", DRY, 5, ["did you mean 'compressed-tensors'?"]),
     method({"quant_method": "compressed_tensors"})),
    (Case("nan weight for fp8", [*BUILD, "--quantization", "fp8"], 4,
          ["'model.layers.1.mlp.down_proj.weight' has 1 non-finite"]), nan_weight),
]  # fmt: skip


@pytest.mark.parametrize("case,setup", [pytest.param(c, s, id=c.name) for c, s in CASES])
def test_hostile_fp8_input(case: Case, setup: Setup, tmp_path: Path, tiny_llama_dir) -> None:
    run_case(case, tmp=tmp_path, ckpt=setup(tmp_path, tiny_llama_dir))
    assert not (tmp_path / "engine").exists()  # a refused build writes nothing
