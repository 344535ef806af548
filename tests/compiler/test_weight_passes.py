"""Weight passes: engine tensors are exact fusions/casts of the checkpoint's; bad tensors fail."""

from __future__ import annotations

import pytest
import torch

from llmc.base.errors import CheckpointError
from llmc.compiler.checkpoint import load_checkpoint
from llmc.compiler.weight_passes import TORCH_DTYPES, to_engine_weights


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_tensors_are_exact_concatenations(fixture, dtype, request):
    ckpt = load_checkpoint(request.getfixturevalue(fixture))
    spec, hf, dt = ckpt.spec, ckpt.tensors, TORCH_DTYPES[dtype]
    eng = to_engine_weights(spec, hf, dtype, source=fixture)

    assert {k: tuple(v.shape) for k, v in eng.items()} == spec.tensor_shapes()
    assert all(t.dtype == dt and t.is_contiguous() for t in eng.values())

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and torch.equal(a, b)

    assert same(eng["embed_tokens"], hf["model.embed_tokens.weight"].to(dt))
    assert same(eng["final_norm"], hf["model.norm.weight"].to(dt))
    assert same(eng["lm_head"], hf["lm_head.weight"].to(dt))
    for n in range(spec.num_layers):
        p, e = f"model.layers.{n}.", f"layers.{n}."
        attn = [hf[p + f"self_attn.{x}_proj.weight"].to(dt) for x in "qkv"]
        assert same(eng[e + "qkv_proj"], torch.cat(attn))
        if spec.qkv_bias:
            bias = [hf[p + f"self_attn.{x}_proj.bias"].to(dt) for x in "qkv"]
            assert same(eng[e + "qkv_bias"], torch.cat(bias))
        mlp = [hf[p + f"mlp.{x}_proj.weight"].to(dt) for x in ("gate", "up")]
        assert same(eng[e + "gate_up_proj"], torch.cat(mlp))
        assert same(eng[e + "o_proj"], hf[p + "self_attn.o_proj.weight"].to(dt))
        assert same(eng[e + "down_proj"], hf[p + "mlp.down_proj.weight"].to(dt))
        assert same(eng[e + "input_norm"], hf[p + "input_layernorm.weight"].to(dt))
        assert same(eng[e + "post_attn_norm"], hf[p + "post_attention_layernorm.weight"].to(dt))
    assert ("layers.0.qkv_bias" in eng) == (fixture == "tiny_qwen2_dir")


def test_tied_checkpoint_may_store_lm_head_and_rotary_buffers(tiny_llama_dir):
    import dataclasses

    ckpt = load_checkpoint(tiny_llama_dir)
    tied = dataclasses.replace(ckpt.spec, tie_word_embeddings=True)
    hf = dict(ckpt.tensors)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    eng = to_engine_weights(tied, hf, "float32")
    assert "lm_head" not in eng and set(eng) == set(tied.tensor_shapes())


def test_bad_tensors_name_the_tensor(tiny_qwen2_dir):
    ckpt = load_checkpoint(tiny_qwen2_dir)
    spec = ckpt.spec

    hf = dict(ckpt.tensors)
    del hf["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointError, match=r"ckpt: tensor 'model.layers.1.self_attn.k_proj"):
        to_engine_weights(spec, hf, "float32", source="ckpt")

    hf = dict(ckpt.tensors, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.2.mlp.up_proj"):
        to_engine_weights(spec, hf, "float32", source="ckpt")

    hf = dict(ckpt.tensors)
    hf["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(33, spec.hidden_size)
    with pytest.raises(CheckpointError, match=r"v_proj.weight' has shape \[33, 64\], expected"):
        to_engine_weights(spec, hf, "float32", source="ckpt")
