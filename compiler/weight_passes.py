"""Weight passes: HF tensor names → the engine's execution layout (see compiler/spec.py).

Fuses Q/K/V (and their biases) into one matrix, gate/up into one matrix, casts to the
engine dtype and makes every tensor contiguous. Validates the checkpoint against the
ModelSpec first: a missing, unexpected or mis-shaped tensor is a CheckpointError naming it
(expected vs got). The fused tensors are exact concatenations: fused == cat(originals) bit
for bit after the same cast.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llmc.base.errors import CheckpointError
from llmc.compiler.spec import ModelSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Tensors a checkpoint may carry that the engine does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape for a checkpoint of this spec."""
    h, i, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (spec.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (spec.num_kv_heads * hd, h)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (spec.num_heads * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (spec.num_kv_heads * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (spec.num_kv_heads * hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, spec.num_heads * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def validate_hf_tensors(
    spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint"
) -> None:
    """Raise CheckpointError for a missing, unexpected or mis-shaped tensor."""
    expected = expected_hf_shapes(spec)
    got = {k: tuple(v) for k, v in shapes.items() if not k.endswith(IGNORED_SUFFIXES)}
    if spec.tie_word_embeddings:
        got.pop("lm_head.weight", None)  # some tied checkpoints still store it
    missing = [k for k in expected if k not in got]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing{more}")
    unexpected = [k for k in got if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r}{more}")
    for k, shape in expected.items():
        if got[k] != shape:
            raise CheckpointError(
                f"{source}: tensor {k!r} has shape {list(got[k])}, expected {list(shape)}"
            )


def to_engine_weights(
    spec: ModelSpec, hf: Mapping[str, torch.Tensor], dtype: str, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Fuse and cast HF tensors into engine tensors (names and shapes: spec.tensor_shapes())."""
    validate_hf_tensors(spec, {k: tuple(v.shape) for k, v in hf.items()}, source)
    dt = TORCH_DTYPES[dtype]

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dt).contiguous()

    out: dict[str, torch.Tensor] = {"embed_tokens": cast(hf["model.embed_tokens.weight"])}
    for n in range(spec.num_layers):
        p, e = f"model.layers.{n}.", f"layers.{n}."
        a = p + "self_attn."
        out[e + "input_norm"] = cast(hf[p + "input_layernorm.weight"])
        out[e + "qkv_proj"] = torch.cat(
            [cast(hf[a + f"{x}_proj.weight"]) for x in "qkv"], dim=0
        ).contiguous()
        if spec.qkv_bias:
            out[e + "qkv_bias"] = torch.cat(
                [cast(hf[a + f"{x}_proj.bias"]) for x in "qkv"], dim=0
            ).contiguous()
        out[e + "o_proj"] = cast(hf[a + "o_proj.weight"])
        out[e + "post_attn_norm"] = cast(hf[p + "post_attention_layernorm.weight"])
        out[e + "gate_up_proj"] = torch.cat(
            [cast(hf[p + "mlp.gate_proj.weight"]), cast(hf[p + "mlp.up_proj.weight"])], dim=0
        ).contiguous()
        out[e + "down_proj"] = cast(hf[p + "mlp.down_proj.weight"])
    out["final_norm"] = cast(hf["model.norm.weight"])
    if not spec.tie_word_embeddings:
        out["lm_head"] = cast(hf["lm_head.weight"])
    return out
