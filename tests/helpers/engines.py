"""Tiny CPU engines and the limits a test runs under.

- ``tiny_build_config``: the BuildConfig of every tiny CPU engine (float32, target cpu);
  conftest's ``tiny_engine`` factory builds it, the ``LLM(build_config=...)`` tests pass it;
- ``SMOLLM2``: SmolLM2-135M's ModelSpec, for dummy weights of a real shape;
- ``SMALL_LIMITS``: the limits of the small engine the bench, profile and limits tests share;
- ``make_limits``: EngineLimits for a test (max_input_len defaults to max_seq_len, chunked
  prefill on, float32, no quantization);
- ``pop_limits``: the EngineLimits fields taken out of a helper's keyword arguments;
- ``load_engine_weights``: (ModelSpec, engine weights) of a checkpoint, without a build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from llmc.compiler.build_config import BuildConfig
from llmc.compiler.limits import EngineLimits
from llmc.compiler.spec import ModelSpec
from llmc.compiler.weight_passes import to_engine_weights

SMOLLM2 = ModelSpec(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
"""SmolLM2-135M's shape (for dummy weights on the GPU)."""

SMOLLM2_HF = {  # SMOLLM2 as an HF config.json (dummy-weight builds of its shape)
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip

SMALL_LIMITS: dict[str, int] = dict(
    max_seq_len=128, max_input_len=64, max_num_tokens=64, max_batch_size=8, tokens_per_block=16
)


def tiny_build_config(checkpoint: Path | None = None, **fields: Any) -> BuildConfig:
    """A float32 CPU build of ``checkpoint``; ``fields``: other BuildConfig fields (limits)."""
    ckpt = None if checkpoint is None else str(checkpoint)
    return BuildConfig(**{"checkpoint_dir": ckpt, "dtype": "float32", "target": "cpu", **fields})


def make_limits(
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    tokens_per_block: int,
    max_input_len: int | None = None,
    enable_chunked_prefill: bool = True,
    dtype: str = "float32",
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    max_beam_width: int = 1,
    float_projections: tuple[str, ...] = (),
) -> EngineLimits:
    """EngineLimits for a test (max_input_len defaults to max_seq_len)."""
    return EngineLimits(
        max_batch_size=max_batch_size,
        max_input_len=max_seq_len if max_input_len is None else max_input_len,
        max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens,
        tokens_per_block=tokens_per_block,
        enable_chunked_prefill=enable_chunked_prefill,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        max_beam_width=max_beam_width,
        float_projections=float_projections,
    )


def pop_limits(kw: dict[str, Any]) -> dict[str, Any]:
    """Remove the EngineLimits fields from ``kw`` and return them (the rest stays in ``kw``)."""
    return {k: kw.pop(k) for k in EngineLimits.field_names() if k in kw}


def load_engine_weights(
    ckpt: Path, dtype: str = "float32"
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(ModelSpec, engine weights: fused and cast as a build writes them) of an HF checkpoint."""
    spec = ModelSpec.from_hf_config(json.loads((ckpt / "config.json").read_text()))
    return spec, to_engine_weights(spec, load_file(str(ckpt / "model.safetensors")), dtype)
