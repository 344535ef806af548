"""Dummy weights: engine layout, deterministic per seed and per tensor, numerically sane."""

from __future__ import annotations

import pytest
import torch

from llmc.base.errors import ConfigError
from llmc.compiler.dummy import dummy_weights
from llmc.compiler.spec import ModelSpec


def _spec(num_layers: int = 2, arch: str = "LlamaForCausalLM", **kw) -> ModelSpec:
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qkv_bias=arch == "Qwen2ForCausalLM",
    )
    return ModelSpec(architecture=arch, **{**base, **kw})


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_shapes_dtype_and_determinism(arch, dtype):
    spec = _spec(arch=arch, tie_word_embeddings=arch == "Qwen2ForCausalLM")
    a = dummy_weights(spec, dtype, seed=7)
    b = dummy_weights(spec, dtype, seed=7)
    c = dummy_weights(spec, dtype, seed=8)
    assert {k: tuple(v.shape) for k, v in a.items()} == spec.tensor_shapes()
    assert all(t.dtype == getattr(torch, dtype) and t.device.type == "cpu" for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    random = [k for k in a if not k.endswith("norm")]
    assert all(not torch.equal(a[k], c[k]) for k in random)
    assert all(torch.equal(a[k], torch.ones_like(a[k])) for k in a if k.endswith("norm"))
    # every tensor is its own stream: no two tensors of the same shape repeat values
    assert not torch.equal(a["layers.0.qkv_proj"], a["layers.1.qkv_proj"])


def test_values_do_not_depend_on_other_tensors():
    two, four = dummy_weights(_spec(2), "float32", 3), dummy_weights(_spec(4), "float32", 3)
    assert torch.equal(two["layers.1.gate_up_proj"], four["layers.1.gate_up_proj"])
    assert torch.equal(two["embed_tokens"], four["embed_tokens"])


def test_scales():
    spec = _spec(num_layers=8, hidden_size=256, intermediate_size=512, head_dim=64)
    w = dummy_weights(spec, "float32", 0)
    assert w["layers.0.qkv_proj"].std().item() == pytest.approx(0.02, rel=0.05)
    assert w["layers.0.down_proj"].std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert w["layers.0.qkv_proj"].mean().abs().item() < 1e-3


def test_bad_dtype_and_seed():
    with pytest.raises(ConfigError, match="int8"):
        dummy_weights(_spec(), "int8", 0)
    with pytest.raises(ConfigError, match="seed"):
        dummy_weights(_spec(), "float32", "0")  # type: ignore[arg-type]


def test_activations_stay_sane_over_32_layers():
    """Run transformers' Llama on dummy weights: finite logits, residual grows slowly."""
    import transformers

    spec = _spec(num_layers=32, hidden_size=128, intermediate_size=256, head_dim=32)
    w = dummy_weights(spec, "float32", 0)
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    hf = {"model.embed_tokens.weight": w["embed_tokens"], "model.norm.weight": w["final_norm"]}
    hf["lm_head.weight"] = w["lm_head"]
    q, kv, i = spec.q_size, spec.kv_size, spec.intermediate_size
    for n in range(spec.num_layers):
        p, e = f"model.layers.{n}.", f"layers.{n}."
        qkv, gate_up = w[e + "qkv_proj"], w[e + "gate_up_proj"]
        hf[p + "self_attn.q_proj.weight"] = qkv[:q]
        hf[p + "self_attn.k_proj.weight"] = qkv[q : q + kv]
        hf[p + "self_attn.v_proj.weight"] = qkv[q + kv :]
        hf[p + "self_attn.o_proj.weight"] = w[e + "o_proj"]
        hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate_up[:i], gate_up[i:]
        hf[p + "mlp.down_proj.weight"] = w[e + "down_proj"]
        hf[p + "input_layernorm.weight"] = w[e + "input_norm"]
        hf[p + "post_attention_layernorm.weight"] = w[e + "post_attn_norm"]
    model.load_state_dict(hf, strict=True)
    ids = torch.arange(24).reshape(1, 24) * 7 % spec.vocab_size
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    first, last = out.hidden_states[0].std().item(), out.hidden_states[-2].std().item()
    assert torch.isfinite(out.logits).all()
    assert last < 4 * first, (first, last)


@pytest.mark.cuda
def test_generated_on_the_gpu_deterministically():
    spec = _spec(num_layers=4, hidden_size=1024, intermediate_size=2816, head_dim=128, num_heads=8)
    a = dummy_weights(spec, "bfloat16", seed=1, device="cuda")
    b = dummy_weights(spec, "bfloat16", seed=1, device="cuda")
    assert all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["layers.0.qkv_proj"].float().std().item() == pytest.approx(0.02, rel=0.02)
