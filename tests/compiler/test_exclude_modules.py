"""``--exclude_modules``: patterns → the projections a quantized engine keeps in its
activation dtype (compiler/exclude_modules.py), through BuildConfig, the build (tensor
table, manifest, report, memory plan), ``llmc build`` and pre-quantized FP8 checkpoints
whose ignore list leaves projections in float."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers.engines import SMALL_LIMITS, SMOLLM2, tiny_build_config
from helpers.fp8_checkpoints import write_fp8_checkpoint
from llmc.base.errors import CheckpointError, ConfigError, EngineError
from llmc.cli.main import app
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build
from llmc.compiler.engine_format import load_engine
from llmc.compiler.exclude_modules import resolve_exclude_modules
from llmc.compiler.limits import EngineLimits
from llmc.compiler.quantization import FP8_PROJECTIONS

LAST = ("layers.29.qkv_proj", "layers.29.o_proj", "layers.29.gate_up_proj", "layers.29.down_proj")


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)


@pytest.mark.parametrize(
    ("patterns", "want"),
    [
        (["model.layers.29.mlp.*"], LAST[2:]),
        (["model.layers.29.mlp"], LAST[2:]),  # a module names what is in it
        (["*.29.mlp.down_proj"], LAST[3:]),
        (["model.layers.29"], LAST),
        (["layers.29"], LAST),  # llmc's names
        (["layers.29.gate_up_proj", "layers.29.down_proj"], LAST[2:]),
        (["model.layers.29.mlp.gate_up_proj"], LAST[2:2] + ("layers.29.gate_up_proj",)),  # vLLM
        (["model.layers.29.self_attn.q_proj", "model.layers.29.self_attn.[kv]_proj"], LAST[:1]),
        (["model.layers.2[89].mlp.down_proj"], ("layers.28.down_proj", "layers.29.down_proj")),
    ],
)
def test_patterns_resolve_to_engine_projections(patterns, want):
    got, notes = resolve_exclude_modules(SMOLLM2, patterns)
    assert got == want and notes == ()


def test_every_projection_and_the_order():
    got, _ = resolve_exclude_modules(SMOLLM2, ["*.down_proj", "*"])
    assert len(got) == 4 * 30 and got[:4] == tuple(f"layers.0.{p}" for p in FP8_PROJECTIONS)


def test_a_pattern_of_modules_that_stay_float_anyway_is_a_note():
    got, notes = resolve_exclude_modules(SMOLLM2, ["lm_head", "model.layers.29.mlp.down_proj"])
    assert got == ("layers.29.down_proj",)
    assert len(notes) == 1 and "'lm_head'" in notes[0] and "nothing to exclude" in notes[0]


@pytest.mark.parametrize(
    ("patterns", "fragments"),
    [
        (["model.layers.29.mlp.gate_proj"], ["'model.layers.29.mlp.gate_proj'", "only part",
                                             "not model.layers.29.mlp.up_proj"]),
        (["*.q_proj"], ["'*.q_proj'", "only part of the fused projection layers.0.qkv_proj"]),
        (["model.layer.29.mlp.down_proj"], ["matches no module", "did you mean "
                                            "'model.layers.29.mlp.down_proj'"]),
        (["model.layers.30.mlp"], ["'model.layers.30.mlp' matches no module", "30 layers"]),
        ([""], ["non-empty"]),
    ],
)  # fmt: skip
def test_bad_patterns_are_refused_naming_them(patterns, fragments):
    with pytest.raises(ConfigError) as e:
        resolve_exclude_modules(SMOLLM2, patterns)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_build_settings_check_the_flag():
    assert BuildConfig(quantization="fp8", exclude_modules=["a", "a", "b"]).exclude_modules == (
        "a", "b",
    )  # fmt: skip
    assert BuildConfig(quantization="int4_wo", exclude_modules="x").exclude_modules == ("x",)
    for q in ("none", "auto"):
        with pytest.raises(ConfigError, match="needs\n?.*--quantization fp8"):
            BuildConfig(quantization=q, exclude_modules=("model.layers.1.mlp",))
    with pytest.raises(ConfigError, match="list of module-name patterns"):
        BuildConfig(quantization="fp8", exclude_modules=[3])


def test_engine_limits_check_float_projections():
    base = dict(max_batch_size=1, max_input_len=8, max_seq_len=8, max_num_tokens=8,
                tokens_per_block=8, enable_chunked_prefill=True, dtype="bfloat16")  # fmt: skip
    lim = EngineLimits(**base, quantization="fp8", float_projections=["layers.1.o_proj"])
    assert lim.float_projections == ("layers.1.o_proj",)  # a manifest's list, as a tuple
    for bad in (["layers.1.o"], ["model.layers.1.o_proj"], ["layers.1.o_proj"] * 2):
        with pytest.raises(ConfigError):
            EngineLimits(**base, quantization="fp8", float_projections=bad)
    with pytest.raises(ConfigError, match="not to quantization 'none'"):
        EngineLimits(**base, float_projections=["layers.1.o_proj"])


def test_a_mixed_fp8_build_stores_what_it_says(tiny_llama_dir, tmp_path):
    cfg = tiny_build_config(
        tiny_llama_dir, output_dir=str(tmp_path / "e"), quantization="fp8", kv_cache_dtype="fp8",
        exclude_modules=("model.layers.1.mlp.*",), dtype="bfloat16", **SMALL_LIMITS,
    )  # fmt: skip
    whole = build(cfg.replace(output_dir=str(tmp_path / "w"), exclude_modules=()))
    result = build(cfg)
    floats = ("layers.1.gate_up_proj", "layers.1.down_proj")
    assert list(result.manifest["build"]["float_projections"]) == list(floats)
    q = result.manifest["quantization"]
    assert q["float_projections"] == list(floats)
    assert "2 projection(s) excluded, in bfloat16" in q["weights"]
    assert q["dtypes"]["gate_up_proj"] == {"float8_e4m3fn": 1, "bfloat16": 1}
    assert q["dtypes"]["down_proj_scale"] == {"float32": 1}
    w = load_engine(tmp_path / "e").load_weights("cpu")
    src = load_file(str(tiny_llama_dir / "model.safetensors"))
    p = "model.layers.1.mlp."
    gate_up = torch.cat([src[p + "gate_proj.weight"], src[p + "up_proj.weight"]])
    assert torch.equal(w["layers.1.gate_up_proj"], gate_up.to(torch.bfloat16))
    assert not any(f"{n}_scale" in w for n in floats)
    assert w["layers.0.gate_up_proj"].dtype == torch.float8_e4m3fn
    # the memory plan counts the excluded projections at 2 bytes an element, no scales
    grow = result.plan.weight_bytes_total - whole.plan.weight_bytes_total
    elems = gate_up.numel() + src[p + "down_proj.weight"].numel()
    rows = gate_up.shape[0] + src[p + "down_proj.weight"].shape[0]
    assert grow == elems * (2 - 1) - rows * 4


def test_a_weight_only_build_takes_the_flag(tiny_llama_dir, tmp_path):
    result = build(
        tiny_build_config(
            tiny_llama_dir, output_dir=str(tmp_path / "e"), quantization="int8_wo",
            exclude_modules=("layers.0.qkv_proj",), **SMALL_LIMITS,
        )
    )  # fmt: skip
    layouts = result.manifest["quantization"]["layouts"]
    assert "layers.0.qkv_proj" not in layouts and "layers.1.qkv_proj" in layouts
    w = load_engine(tmp_path / "e").load_weights("cpu")
    assert w["layers.0.qkv_proj"].dtype == torch.float32


def test_llmc_build_flag_and_profile_field(tiny_llama_dir, tmp_path):
    def run(*args):
        return CliRunner().invoke(app, ["build", *map(str, args)])

    base = ("--checkpoint_dir", tiny_llama_dir, "--dry_run", "--json", "--quantization", "fp8")
    r = run(*base, "--exclude_modules", "model.layers.1.mlp.down_proj,layers.0.o_proj",
            "--exclude-modules", "model.layers.1.self_attn")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)["build"]["float_projections"]
    assert got == ["layers.0.o_proj", "layers.1.qkv_proj", "layers.1.o_proj", "layers.1.down_proj"]
    p = tmp_path / "p.yaml"
    p.write_text("build:\n  exclude_modules: ['model.layers.1.mlp']\n")
    r = run(*base, "--profile", p)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["build"]["float_projections"] == [
        "layers.1.gate_up_proj", "layers.1.down_proj",
    ]  # fmt: skip
    r = run(*base, "--exclude_modules", "model.layers.1.mlp.up_proj")
    assert r.exit_code == 3 and "Traceback" not in r.stderr
    assert "only part of the fused projection layers.1.gate_up_proj" in r.stderr


def _keep_float(names: list[str], src: dict[str, torch.Tensor]):
    """An edit leaving ``names`` (HF weights) in float, as a checkpoint's ignore list does."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        for n in names:
            base = n.removesuffix("weight")
            t[n] = src[n]
            for s in ("weight_scale", "input_scale"):
                t.pop(base + s, None)

    return edit


def test_a_prequantized_checkpoint_keeps_its_float_projections(tiny_llama_dir, tmp_path):
    src = load_file(str(tiny_llama_dir / "model.safetensors"))
    p = "model.layers.1.mlp."
    floats = [p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"]
    d = write_fp8_checkpoint(
        tiny_llama_dir, tmp_path / "ckpt", "ct-channel", edit=_keep_float(floats, src)
    )
    written = load_file(str(d / "model.safetensors"))
    out = tmp_path / "e"
    cfg = tiny_build_config(d, output_dir=str(out), quantization="fp8", **SMALL_LIMITS)
    planned = build(cfg, dry_run=True)  # from the headers: the same plan as the build's
    result = build(cfg)
    assert result.plans[0].limits.float_projections == ("layers.1.gate_up_proj",
                                                        "layers.1.down_proj")  # fmt: skip
    assert planned.plans[0].limits.float_projections == result.plans[0].limits.float_projections
    assert planned.plan.weight_bytes_total == result.plan.weight_bytes_total
    assert [n for n in planned.notes if "ignore list" in n] == [
        n for n in result.notes if "ignore list" in n
    ]
    engine = load_engine(out)
    assert engine.plan.weight_bytes_total == result.plan.weight_bytes_total
    assert result.manifest["quantization"]["engine_weight_bytes"] == result.plan.weight_bytes_total
    assert any("leaves unquantized (its ignore list)" in n for n in result.notes)
    w = engine.load_weights("cpu")
    assert torch.equal(w["layers.1.down_proj"], src[p + "down_proj.weight"])  # kept, not quantized
    assert torch.equal(
        w["layers.1.gate_up_proj"],
        torch.cat([src[p + "gate_proj.weight"], src[p + "up_proj.weight"]]),
    )
    q0 = written["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(w["layers.0.down_proj"].view(torch.uint8), q0.view(torch.uint8))


def test_a_prequantized_fused_family_of_two_dtypes_is_refused(tiny_llama_dir, tmp_path):
    src = load_file(str(tiny_llama_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    d = write_fp8_checkpoint(
        tiny_llama_dir, tmp_path / "ckpt", "fp8-tensor", edit=_keep_float([name], src)
    )
    cfg = tiny_build_config(d, output_dir=str(tmp_path / "e"), quantization="fp8", **SMALL_LIMITS)
    for dry_run in (True, False):  # from the headers, before any tensor is read
        with pytest.raises(CheckpointError, match="fused projection layers.0.qkv_proj"):
            build(cfg, dry_run=dry_run)


def test_an_engine_whose_float_projections_do_not_fit_is_refused(tiny_llama_dir, tmp_path):
    out = tmp_path / "e"
    build(tiny_build_config(
        tiny_llama_dir, output_dir=str(out), quantization="fp8", load_format="dummy",
        exclude_modules=("layers.1.o_proj",), **SMALL_LIMITS,
    ))  # fmt: skip
    assert load_engine(out).load_weights("cpu")["layers.1.o_proj"].dtype == torch.float32
    m = json.loads((out / "manifest.json").read_text())
    m["build"]["float_projections"] = ["layers.7.o_proj"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineError):
        load_engine(out, verify_checksums=False)


def test_the_rebuild_command_repeats_the_patterns(tiny_llama_dir, tmp_path):
    from llmc.compiler.engine_format import rebuild_command

    cfg = tiny_build_config(tiny_llama_dir, quantization="fp8", load_format="dummy", **SMALL_LIMITS)
    pats = ("model.layers.1.mlp", "layers.0.o_proj")
    build(cfg.replace(output_dir=str(tmp_path / "m"), exclude_modules=pats))
    build(cfg.replace(output_dir=str(tmp_path / "w")))
    mixed = json.loads((tmp_path / "m" / "manifest.json").read_text())
    cmd = rebuild_command(mixed, tmp_path / "m")
    assert "--exclude_modules model.layers.1.mlp --exclude_modules layers.0.o_proj" in cmd
    assert "exclude_modules" not in rebuild_command(mixed, tmp_path / "m", quantization="none")
    whole = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert "exclude_modules" not in rebuild_command(whole, tmp_path / "w")
