"""Pre-quantized FP8 checkpoints (tests/helpers/fp8_checkpoints.py writes them from the tiny
Llama): each layout loads to the same values (codes bit-identical, per-tensor scales
broadcast per channel, k/v scales), builds without re-quantizing, and runs; every bad scale,
dtype and config is a clear error naming the tensor or field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.engines import SMALL_LIMITS, tiny_build_config
from helpers.fp8_checkpoints import (
    LAYOUTS,
    config_for,
    kv_scale_values,
    projection_names,
    write_fp8_checkpoint,
)
from helpers.runner import drive, make_runner, new_seq, prompts
from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.builder import build
from llmc.compiler.checkpoint import load_checkpoint, read_model_spec
from llmc.compiler.engine_format import load_engine
from llmc.compiler.weight_passes import fusion_table

Q = "model.layers.0.self_attn.q_proj."


def _written(d):
    return load_file(str(d / "model.safetensors"))


def _row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    return scale.float().reshape(-1).expand(rows)


def _scale_of(written: dict[str, torch.Tensor], weight: str) -> torch.Tensor:
    return written[weight.removesuffix("weight") + "weight_scale"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prequantized_checkpoint_loads_to_its_values(layout, tiny_llama_dir, tmp_path):
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", layout)
    written = _written(d)
    ckpt = load_checkpoint(d)
    assert ckpt.fp8 is not None and not any(k.endswith("_scale") for k in ckpt.tensors)
    for name in projection_names(ckpt.spec.num_layers):
        base = name.removesuffix("weight")
        assert torch.equal(_bits(ckpt.tensors[name]), _bits(written[name])), name
        rows = written[name].shape[0]
        want = _row_scale(written[base + "weight_scale"], rows)
        assert torch.equal(ckpt.fp8.weight_scales[name], want), name
        assert ckpt.fp8.weight_scales[name].dtype == torch.float32
    assert ckpt.tensors["lm_head.weight"].dtype == torch.float32  # ignored: left as it is
    assert ckpt.fp8.kv_scales == {n: kv_scale_values(n) for n in range(ckpt.spec.num_layers)}
    assert ckpt.fp8.input_scales == (0 if layout == "ct-channel" else 14)
    assert ckpt.fp8.per_channel == (14 if layout == "ct-channel" else 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prequantized_checkpoint_builds_without_requantizing(layout, tiny_llama_dir, tmp_path):
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", layout)
    written = _written(d)
    out = tmp_path / "engine"
    cfg = tiny_build_config(
        d, output_dir=str(out), quantization="fp8", kv_cache_dtype="fp8", **SMALL_LIMITS
    )
    result = build(cfg)
    assert any("pre-quantized FP8 checkpoint" in n for n in result.notes)
    if layout != "ct-channel":
        assert any("input_scale values validated, not used" in n for n in result.notes)
    assert result.manifest["quantization"]["source"].startswith("pre-quantized checkpoint")
    assert "from the checkpoint" in result.manifest["quantization"]["kv_cache"]
    engine = load_engine(out)
    eng = engine.load_weights("cpu")
    spec = engine.spec
    for name, parts in fusion_table(spec).items():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            codes = torch.cat([_bits(written[p]) for p in parts])
            scales = torch.cat([_row_scale(_scale_of(written, p), len(written[p])) for p in parts])
            assert torch.equal(_bits(eng[name]), codes), name
            assert torch.equal(eng[name + "_scale"], scales), name
    for n in range(spec.num_layers):
        assert tuple(eng[f"layers.{n}.kv_scale"].tolist()) == kv_scale_values(n)
    assert torch.equal(eng["lm_head"], written["lm_head.weight"])
    # ... and it runs: the ModelRunner's logits against a float32 engine of the same
    # (dequantized) weights differ only by the activations' per-token quantization
    none = build(tiny_build_config(d, output_dir=str(tmp_path / "none"), **SMALL_LIMITS))
    deq = load_engine(none.output_dir).load_weights("cpu")
    for name in ("layers.0.qkv_proj", "layers.1.gate_up_proj"):  # exactly code x scale
        assert torch.equal(deq[name], eng[name].float() * eng[name + "_scale"][:, None])
    logits = {}
    for key, (weights, lim) in {"fp8": (eng, engine.limits), "deq": (deq, None)}.items():
        extra = {} if lim is None else {"quantization": "fp8", "kv_cache_dtype": "fp8"}
        runner = make_runner(spec, weights, **extra)
        seqs = [new_seq(i, p, 1) for i, p in enumerate(prompts(3, [4, 9, 17], spec.vocab_size))]
        logits[key] = drive(runner, seqs, chunk=32, budget=64, record_logits=True).logits
    for k, ref in logits["deq"].items():
        err = (logits["fp8"][k] - ref).abs().max() / ref.std()
        assert float(err) < 0.5, (k, float(err))


def test_the_scales_are_dequantized_for_an_unquantized_build(tiny_llama_dir, tmp_path):
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", "ct-channel")
    written = _written(d)
    result = build(
        tiny_build_config(d, output_dir=str(tmp_path / "e"), dtype="bfloat16", **SMALL_LIMITS)
    )
    assert any("dequantized to bfloat16" in n for n in result.notes)
    assert any("k/v scales are not used" in n for n in result.notes)
    eng = load_engine(tmp_path / "e").load_weights("cpu")
    w = written["model.layers.1.mlp.down_proj.weight"]
    s = written["model.layers.1.mlp.down_proj.weight_scale"]
    assert torch.equal(eng["layers.1.down_proj"], (w.float() * s.float()).to(torch.bfloat16))


# ---- bad input ---------------------------------------------------------------------------------
def _set(name: str, value: torch.Tensor):
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = value

    return edit


def _drop(name: str):
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t[name]

    return edit


def _nan_code(t: dict[str, torch.Tensor]) -> None:
    w = t[Q + "weight"].clone()
    w.view(torch.uint8)[0, 0] = 0x7F
    t[Q + "weight"] = w


BAD_TENSORS = [
    ("scale missing", _drop(Q + "weight_scale"), CheckpointError, f"{Q}weight_scale' is missing"),
    ("scale zero", _set(Q + "weight_scale", torch.tensor(0.0)), CheckpointError, "zero, negative"),
    ("scale negative", _set(Q + "weight_scale", torch.tensor(-0.01)), CheckpointError, "-0.01"),
    ("scale nan", _set(Q + "weight_scale", torch.tensor(float("nan"))), CheckpointError, "nan"),
    ("scale inf", _set(Q + "weight_scale", torch.tensor(float("inf"))), CheckpointError, "inf"),
    ("scale mis-shaped", _set(Q + "weight_scale", torch.ones(3, 2)), CheckpointError, "[3, 2]"),
    ("scale of ints", _set(Q + "weight_scale", torch.ones((), dtype=torch.int32)), CheckpointError,
     "int32"),
    ("input_scale zero", _set(Q + "input_scale", torch.tensor(0.0)), CheckpointError,
     f"{Q}input_scale"),
    ("input_scale mis-shaped", _set(Q + "input_scale", torch.ones(4)), CheckpointError, "[4]"),
    ("weight e5m2", _set(Q + "weight", torch.zeros(64, 64, dtype=torch.float8_e5m2)),
     UnsupportedError, "float8_e5m2"),
    ("weight bfloat16 with a scale", _set(Q + "weight", torch.zeros(64, 64, dtype=torch.bfloat16)),
     CheckpointError, "not float8_e4m3fn"),
    ("weight NaN code", _nan_code, CheckpointError, "NaN codes"),
    ("scale of a norm", _set("model.norm.weight_scale", torch.tensor(1.0)), CheckpointError,
     "unexpected tensor 'model.norm.weight_scale'"),
    ("k_scale without v_scale", _drop("model.layers.1.self_attn.v_scale"), CheckpointError,
     "has no v_scale"),
    ("k_scale negative", _set("model.layers.0.self_attn.k_scale", torch.tensor(-1.0)),
     CheckpointError, "self_attn.k_scale"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_bad_scales_and_weights_name_the_tensor(case, tiny_llama_dir, tmp_path):
    _, edit, error, says = case
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", "fp8-tensor", edit=edit)
    with pytest.raises(error) as e:
        load_checkpoint(d)
    assert says in str(e.value) and str(d) in str(e.value)


def test_half_the_layers_with_kv_scales_is_refused(tiny_llama_dir, tmp_path):
    def edit(t):
        del t["model.layers.1.self_attn.k_scale"], t["model.layers.1.self_attn.v_scale"]

    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", "ct-tensor", edit=edit)
    with pytest.raises(CheckpointError, match="given for 1 of 2 layers"):
        load_checkpoint(d)


def test_e4m3_weights_without_a_quantization_config_are_refused(tiny_llama_dir, tmp_path):
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", "fp8-tensor", kv=False)
    written = {k: v for k, v in _written(d).items() if not k.endswith("_scale")}
    from safetensors.torch import save_file

    save_file(written, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(d)  # names and shapes are right...
    with pytest.raises(CheckpointError, match=f"tensor '{Q}weight' is float8_e4m3fn"):
        build(tiny_build_config(d, output_dir=str(tmp_path / "e"), **SMALL_LIMITS))
    assert ckpt.fp8 is None


FP8_ARGS = {"type": "float", "num_bits": 8}


def _ct(**changes) -> dict:
    cfg = config_for("ct-tensor", kv=True)
    group = cfg["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in ("weights", "input_activations"):
            group[key] = {**group[key], **value}
        else:
            cfg[key] = value
    return cfg


BAD_CONFIGS = [
    ("gptq", {"quant_method": "gptq", "bits": 4}, UnsupportedError, "'gptq' is not supported"),
    ("typo", {"quant_method": "fp-8"}, UnsupportedError, "did you mean 'fp8'?"),
    ("no method", {"activation_scheme": "static"}, CheckpointError, "quant_method must be"),
    ("not an object", ["fp8"], CheckpointError, "must be an object"),
    ("block-wise", {"quant_method": "fp8", "weight_block_size": [128, 128]}, UnsupportedError,
     "block-wise"),
    ("e5m2", {"quant_method": "fp8", "fmt": "e5m2"}, UnsupportedError, "'e5m2'"),
    ("scheme", {"quant_method": "fp8", "activation_scheme": "sometimes"}, CheckpointError,
     "activation_scheme"),
    ("ct int4", _ct(format="pack-quantized"), UnsupportedError, "'pack-quantized'"),
    ("ct int8", _ct(weights={"type": "int"}), UnsupportedError, "8-bit float"),
    ("ct group", _ct(weights={"strategy": "group"}), UnsupportedError, "'group'"),
    ("ct asymmetric", _ct(weights={"symmetric": False}), UnsupportedError, "asymmetric"),
    ("ct no groups", _ct(config_groups={}), CheckpointError, "config_groups"),
    ("ct kv per head", _ct(kv_cache_scheme={**FP8_ARGS, "strategy": "attn_head"}),
     UnsupportedError, "kv_cache_scheme.strategy"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_unsupported_quantization_configs_name_the_field(case, tiny_llama_dir, tmp_path):
    _, config, error, says = case
    d = write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ckpt", "ct-tensor", config=config)
    with pytest.raises(error) as e:
        read_model_spec(d)  # refused from config.json alone: the dry run fails too
    assert says in str(e.value) and "quantization_config" in str(e.value)
