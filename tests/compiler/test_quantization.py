"""FP8 engines at build: the settings, the engine tensor table, the memory plan, per-channel
quantization of the checkpoint's and of dummy weights, and where fp8 may run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.engines import SMALL_LIMITS, make_limits
from llmc.base.errors import CheckpointError, EngineError, UnsupportedError
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build
from llmc.compiler.checkpoint import load_checkpoint
from llmc.compiler.dummy import dummy_weights
from llmc.compiler.engine_format import load_engine
from llmc.compiler.memory_plan import pack_buffers, plan_memory, plan_mismatch, workspace_buffers
from llmc.compiler.quantization import (
    FP8_PROJECTIONS,
    check_engine_tensors,
    check_fp8_gpu,
    engine_tensors,
)
from llmc.compiler.resolve import GpuInfo, resolve_build
from llmc.compiler.spec import ModelSpec
from llmc.compiler.weight_passes import (
    dequantize_engine_weights,
    fusion_table,
    quantize_engine_weights,
    quantize_projection,
    to_engine_weights,
)
from llmc.cuda.reference_fp8 import quantize_weight_fp8

SPEC = ModelSpec(
    architecture="Qwen2ForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
)
COMBOS = [("none", "auto"), ("fp8", "auto"), ("none", "fp8"), ("fp8", "fp8")]


def limits(quantization: str = "none", kv_cache_dtype: str = "auto", dtype: str = "bfloat16"):
    return make_limits(
        **SMALL_LIMITS, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )


# ---- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, says",
    [
        ("quantization", "fp9", "did you mean 'fp8'?"),
        ("quantization", "int8", "choose one of auto, none, fp8, int8_wo, int4_wo"),
        ("kv_cache_dtype", "fp8e4m3", "did you mean 'fp8'?"),
        ("kv_cache_dtype", "bfloat16", "choose one of auto, fp8"),
    ],
)
def test_unknown_values_are_refused_with_a_suggestion(field, value, says):
    with pytest.raises(UnsupportedError, match=f"{field} '{value}' is not supported") as e:
        BuildConfig(**{field: value})
    assert says in str(e.value)


@pytest.mark.parametrize("target", ["sm_70", "sm_75"])
def test_a_target_below_sm80_is_refused_before_anything(target):
    """The kernels need Ampere (bf16 mma.sync, cp.async): refused at config time, fp8 or not."""
    for quantization in ("none", "fp8"):
        with pytest.raises(UnsupportedError, match=f"target {target}: .* need sm_80") as e:
            BuildConfig(quantization=quantization, target=target)
        assert "--target cpu" in str(e.value) and e.value.exit_code == 5


def test_an_arch_nvcc_does_not_know_is_refused_before_the_weights(monkeypatch):
    from llmc.cuda import build as cuda_build

    monkeypatch.setattr(cuda_build, "nvcc_archs", lambda: ("sm_80", "sm_89", "sm_90"))
    with pytest.raises(UnsupportedError, match="sm_91 is not a GPU arch nvcc knows") as e:
        cuda_build.check_target("sm_91")
    assert "sm_80, sm_89, sm_90" in str(e.value)
    cuda_build.check_target("sm_90")
    monkeypatch.setattr(cuda_build, "nvcc_archs", lambda: ())  # no nvcc: NVRTC says later
    cuda_build.check_target("sm_91")


@pytest.mark.parametrize("target", ["sm_80", "sm_86"])
def test_fp8_for_a_target_below_sm89_is_refused(target):
    with pytest.raises(UnsupportedError, match=f"the target is {target}") as e:
        BuildConfig(quantization="fp8", target=target)
    assert "--quantization none" in str(e.value)
    BuildConfig(quantization="none", kv_cache_dtype="fp8", target=target)  # fp8 KV is fine
    for ok in ("sm_89", "sm_90", "cpu", "auto"):
        BuildConfig(quantization="fp8", target=ok)


def test_fp8_for_a_detected_gpu_below_sm89_is_refused():
    gpu = GpuInfo("NVIDIA A100-SXM4-80GB", "sm_80", 80 << 30, 80 << 30)
    with pytest.raises(UnsupportedError, match="the target is sm_80"):
        resolve_build(BuildConfig(quantization="fp8"), SPEC, gpu)
    built, _ = resolve_build(BuildConfig(quantization="fp8", kv_cache_dtype="fp8"), SPEC, None)
    assert (built.limits.quantization, built.limits.kv_cache_dtype) == ("fp8", "fp8")
    assert built.to_dict()["quantization"] == "fp8"  # the manifest's build section


def test_build_settings_take_both_spellings():
    cfg = BuildConfig.from_dict({"quantization": "fp8", "kv-cache-dtype": "fp8"})
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("fp8", "fp8")


def test_an_fp8_engine_on_an_old_gpu_names_it_and_the_fix():
    with pytest.raises(UnsupportedError) as e:
        check_fp8_gpu(limits("fp8"), "NVIDIA A100", "sm_80", "llmc build X --force")
    msg = str(e.value)
    assert "NVIDIA A100 is sm_80" in msg and "--quantization none: llmc build X" in msg
    check_fp8_gpu(limits("fp8"), "NVIDIA H200", "sm_90", "")
    check_fp8_gpu(limits("none", "fp8"), "NVIDIA A100", "sm_80", "")  # fp8 KV only


# ---- the engine tensor table and the memory plan -------------------------------------------
@pytest.mark.parametrize("quant, kv", COMBOS)
def test_engine_tensor_table(quant, kv):
    table = engine_tensors(SPEC, limits(quant, kv))
    shapes = SPEC.tensor_shapes()
    for name, shape in shapes.items():
        fp8 = quant == "fp8" and name.rsplit(".", 1)[-1] in FP8_PROJECTIONS
        assert table[name] == (shape, "float8_e4m3fn" if fp8 else "bfloat16")
        if fp8:
            assert table[name + "_scale"] == ((shape[0],), "float32")
    scales = [n for n in table if n.endswith("_scale") and not n.endswith("kv_scale")]
    assert len(scales) == (4 * SPEC.num_layers if quant == "fp8" else 0)
    kv_scales = [n for n in table if n.endswith("kv_scale")]
    assert kv_scales == ([f"layers.{i}.kv_scale" for i in range(2)] if kv == "fp8" else [])
    assert all(table[n] == ((2,), "float32") for n in kv_scales)
    k_means = [n for n in table if n.endswith("k_mean")]  # smooth K, one per layer
    assert k_means == ([f"layers.{i}.k_mean" for i in range(2)] if kv == "fp8" else [])
    kv_shape = (SPEC.num_kv_heads, SPEC.head_dim)
    assert all(table[n] == (kv_shape, "float32") for n in k_means)
    assert len(table) == len(shapes) + len(scales) + len(kv_scales) + len(k_means)


@pytest.mark.parametrize("quant, kv", COMBOS)
def test_memory_plan_counts_fp8_bytes_and_buffers(quant, kv):
    lim = limits(quant, kv)
    plan, bf16 = plan_memory(SPEC, lim), plan_memory(SPEC, limits())
    codes = sum(2 * (o * i) for n, (o, i) in _projections().items())  # bf16 bytes
    scales = sum(4 * o for o, _ in _projections().values())
    want = bf16.weight_bytes_total
    if quant == "fp8":
        want += -codes + codes // 2 + scales
    if kv == "fp8":  # kv_scale [2] and k_mean [nkv, hd] float32 per layer
        want += SPEC.num_layers * (8 + 4 * SPEC.num_kv_heads * SPEC.head_dim)
    assert plan.weight_bytes_total == want
    # KV bytes per token: 1 byte per element for fp8 (half of bf16: the pool holds twice)
    assert plan.kv_bytes_per_token * (2 if kv == "fp8" else 1) == bf16.kv_bytes_per_token
    names = {b.name: b for b in workspace_buffers(SPEC, lim)}
    fp8_rows = {"normed_fp8": 64, "attn_out_fp8": 64, "act_fp8": 160}
    for name, width in fp8_rows.items():
        if quant != "fp8":
            assert name not in names and name + "_scale" not in names
            continue
        t = lim.max_num_tokens
        assert (names[name].shape, names[name].dtype) == ((t, width), "float8_e4m3fn")
        assert (names[name + "_scale"].shape, names[name + "_scale"].dtype) == ((t,), "float32")
    placed, packed, naive = pack_buffers(list(names.values()))
    for a in placed:  # buffers alive at the same op never share bytes
        for b in placed:
            if a.name < b.name and a.overlaps_in_time(b):
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    assert packed <= naive and plan_mismatch(plan, SPEC) is None
    if quant == "fp8":  # a plan made for other settings is refused at load
        other = dataclasses.replace(plan, limits=limits("none", kv))
        assert plan_mismatch(other, SPEC) is not None


def _projections() -> dict[str, tuple[int, int]]:
    return {
        n: s for n, s in SPEC.tensor_shapes().items() if n.rsplit(".", 1)[-1] in FP8_PROJECTIONS
    }


def test_capacity_doubles_with_an_fp8_kv_cache():
    gib = 1 << 30
    a = plan_memory(SPEC, limits(), device_memory_bytes=gib).capacity
    b = plan_memory(SPEC, limits("none", "fp8"), device_memory_bytes=gib).capacity
    assert a is not None and b is not None
    assert b.kv_tokens in (2 * a.kv_tokens, 2 * a.kv_tokens + SMALL_LIMITS["tokens_per_block"])


# ---- quantization of weights ---------------------------------------------------------------
def test_projection_quantization_is_per_output_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]
    q, s = quantize_projection("w", w, "ckpt")
    want_q, want_s = quantize_weight_fp8(w)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (48,)
    assert torch.equal(s, w.abs().amax(dim=1) / 448)  # every row's largest value is ±448
    err = (q.float() * s[:, None] - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert float(err.max()) <= 2**-4  # e4m3: 3 mantissa bits, relative to the row's amax


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tiny_llama_dir, bad):
    ckpt = load_checkpoint(tiny_llama_dir)
    hf = dict(ckpt.tensors)
    name = "model.layers.1.mlp.up_proj.weight"
    hf[name] = hf[name].clone()
    hf[name][3, 7] = bad
    with pytest.raises(CheckpointError, match=f"ckpt: tensor '{name}' has 1 non-finite"):
        to_engine_weights(ckpt.spec, hf, "bfloat16", "ckpt", quantization="fp8")
    to_engine_weights(ckpt.spec, hf, "bfloat16", "ckpt")  # unquantized: values as they are


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_fp8_engine_weights_from_a_float_checkpoint(fixture, request):
    ckpt = load_checkpoint(request.getfixturevalue(fixture))
    spec, hf = ckpt.spec, ckpt.tensors
    lim = dataclasses.replace(limits("fp8", "fp8"), dtype="float32")
    eng = to_engine_weights(
        spec, hf, "float32", quantization="fp8", kv_cache_dtype="fp8", source=fixture
    )
    check_engine_tensors(eng, spec, lim, fixture)
    for name, parts in fusion_table(spec).items():
        if name.rsplit(".", 1)[-1] not in FP8_PROJECTIONS:
            assert torch.equal(eng[name], torch.cat([hf[p] for p in parts]))
            continue
        q, s = quantize_weight_fp8(torch.cat([hf[p].float() for p in parts]))
        assert torch.equal(eng[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(eng[name + "_scale"], s), name
    for i in range(spec.num_layers):
        assert eng[f"layers.{i}.kv_scale"].tolist() == [1.0, 1.0]
        assert not eng[f"layers.{i}.k_mean"].any()  # smooth K off until llmc calibrate
    back = dequantize_engine_weights(eng, "float32")
    assert set(back) == set(spec.tensor_shapes())
    ref = to_engine_weights(spec, hf, "float32")
    for name in ref:
        rel = (back[name] - ref[name]).abs().max() / ref[name].abs().max()
        assert float(rel) <= 2**-4, name


def test_dummy_fp8_weights_are_the_quantized_dummy_weights(tmp_path):
    model = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256,
    }  # fmt: skip
    cfg = BuildConfig(
        output_dir=str(tmp_path / "e"), load_format="dummy", dummy_seed=3, dtype="bfloat16",
        target="cpu", quantization="fp8", kv_cache_dtype="fp8", **SMALL_LIMITS,
    )  # fmt: skip
    result = build(cfg, model_config=model)
    assert result.manifest["quantization"]["source"].startswith("dummy weights")
    engine = load_engine(tmp_path / "e")
    got = engine.load_weights("cpu")
    bf16 = dummy_weights(engine.spec, "bfloat16", 3)
    want = quantize_engine_weights(engine.spec, bf16.items(), "fp8", "fp8", "dummy")
    assert set(got) == set(want) == set(engine_tensors(engine.spec, engine.limits))
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].float(), t.float()), name
    assert got["layers.0.qkv_proj"].dtype == torch.float8_e4m3fn
    assert got["embed_tokens"].dtype == torch.bfloat16


def test_engine_tensor_checks_name_the_tensor():
    lim = limits("fp8", "fp8")
    good = quantize_engine_weights(
        SPEC, dummy_weights(SPEC, "bfloat16", 0).items(), "fp8", "fp8", "dummy"
    )
    check_engine_tensors(good, SPEC, lim, "w")
    cases = {
        "layers.1.o_proj": good["layers.1.o_proj"].float(),  # not e4m3
        "layers.0.down_proj_scale": good["layers.0.down_proj_scale"].half(),
        "layers.0.gate_up_proj_scale": good["layers.0.gate_up_proj_scale"][:-1],
        "layers.1.kv_scale": torch.ones(3),
        "layers.0.k_mean": good["layers.0.k_mean"][:, :-1],
        "layers.1.k_mean": good["layers.1.k_mean"].bfloat16(),
    }
    for name, bad in cases.items():
        with pytest.raises(EngineError, match=f"w: tensor '{name}' is"):
            check_engine_tensors({**good, name: bad}, SPEC, lim, "w")
        with pytest.raises(EngineError, match=f"w: tensor '{name}' is"):  # never cast
            check_engine_tensors({**good, name: bad}, SPEC, lim, "w", cast_ok=True)
    float_norm = {**good, "final_norm": good["final_norm"].float()}
    with pytest.raises(EngineError, match="'final_norm' is \\[64\\] float32, expected"):
        check_engine_tensors(float_norm, SPEC, lim, "w")
    check_engine_tensors(float_norm, SPEC, lim, "w", cast_ok=True)  # the runner casts it
    with pytest.raises(EngineError, match="tensor 'layers.0.kv_scale' is missing"):
        check_engine_tensors(
            {k: v for k, v in good.items() if k != "layers.0.kv_scale"}, SPEC, lim, "w"
        )
    with pytest.raises(EngineError, match="unexpected tensor 'layers.0.down_proj_scale'"):
        check_engine_tensors(good, SPEC, limits("none", "fp8"), "w", cast_ok=True)
