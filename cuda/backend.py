"""The op interface every backend implements, and the per-step metadata it receives.

Two backends share it: ``TorchBackend`` (the reference: plain torch ops, runs on CPU and
CUDA) and ``CudaBackend`` (CuPy RawKernels on torch's current stream + cuBLAS matmuls).
The ModelRunner runs the same op sequence on either; the torch reference of every op lives
in ``llmc.cuda.reference`` and is what the kernels are checked against.

Conventions (shapes in comments; T = tokens in the step, B = sequences in the step,
S = sequences sampled this step, H = hidden, V = vocab, nq/nkv = heads, hd = head_dim):

- The step's tokens are flattened with no padding. Sequences are ordered decode-first
  (``num_decode_seqs`` sequences with exactly one new token each), then prefill chunks.
- KV cache of one layer: ``k_cache``, ``v_cache`` each ``[num_blocks, tokens_per_block, nkv, hd]``.
  A token's *slot* is ``block_id * tokens_per_block + offset``; slot ``-1`` means "padding
  row: do not write" (CUDA-graph padding).
- RoPE is the HF "rotate_half" (NeoX) form over the full head_dim, with cos/sin tables
  ``[max_position, hd // 2]`` (float32) precomputed from ModelSpec (incl. llama3 scaling).
- Attention is causal per sequence: query token at position p attends to cached keys at
  positions 0..p of its own sequence (its earlier blocks, then this step's chunk), scale
  ``1/sqrt(hd)``, GQA: query head h reads kv head ``h // (nq // nkv)``.
- Sampling uses a counter-based RNG so results do not depend on the batch: for a sampled
  row with seed s at output index n, the uniform for vocab entry v is
  ``llmc.cuda.reference.philox_uniform(s, n, v)``; the token is the Gumbel-max
  ``argmax(log p_v - log(-log u_v))`` over the filtered distribution (top-k, top-p, min-p).
  Greedy rows (temperature 0) take argmax of the logits (after penalties), first index on ties.
- Small-step fusions: a backend whose ``fused_decode_max_tokens`` attribute is > 0 (absent
  = 0) also implements ``norm_linear``, ``norm_gate_up_silu`` and ``linear_residual_add``;
  the ModelRunner runs steps of ``0 < T <= fused_decode_max_tokens`` tokens through them
  (qkv, gate_up + SiLU, o_proj / down + residual add). Each computes exactly what its
  unfused op sequence computes, every intermediate rounded to the activation dtype
  (``llmc.cuda.reference``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmc.base.errors import ConfigError


@dataclass
class AttentionMetadata:
    """Per-step tensors (on the backend's device) describing the flattened batch."""

    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, cache slot to write, -1 = skip
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, offsets of each sequence's tokens
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, -1 padded
    num_decode_seqs: int  # the first num_decode_seqs sequences have one token each
    max_query_len: int
    max_seq_len: int
    # Split-KV (flash-decoding) scratch from the memory plan's workspace, for backends that
    # use it (shapes: the plan's attn_partial_out / attn_partial_lse); None = not provided.
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters for the S sampled rows (tensors on the device)."""

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int32, 0 = off
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    offsets: torch.Tensor  # [S] int64, output index n of the token being sampled
    repetition_penalty: torch.Tensor  # [S] float32
    presence_penalty: torch.Tensor  # [S] float32
    frequency_penalty: torch.Tensor  # [S] float32
    # token counts for penalties: [S, V] int32 of output-token counts and a prompt-presence
    # mask; None when no row uses a penalty (the common case costs nothing).
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    all_greedy: bool = False
    num_logprobs: int | None = None  # max top-logprobs requested by any row, None = none


def check_fused_decode_max_tokens(n: object, backend: str, most: int | None = None) -> int:
    """``n`` when it is a valid ``fused_decode_max_tokens`` for ``backend`` (an integer, not
    a bool, in 0..``most``; no upper bound when ``most`` is None), else ConfigError."""
    is_int = isinstance(n, int) and not isinstance(n, bool)
    if is_int and n >= 0 and (most is None or n <= most):
        return n
    allowed = ">= 0" if most is None else f"in 0..{most}"
    raise ConfigError(f"{backend}: fused_decode_max_tokens must be an integer {allowed}, got {n!r}")


BackendOp = Callable[..., Any]
"""One op of a backend: a method taking the parameters of the op's reference function
(``llmc.cuda.reference``; same names, same order), then ``out`` unless the op is in
``OPS_WITHOUT_OUT``."""

REFERENCE_NAMES = {"attention": "paged_attention"}
"""Backend op → the name of its reference function, where the two differ."""

FP8_OPS = frozenset(
    {
        "quantize_fp8", "rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8", "linear_fp8",
        "norm_linear_fp8", "norm_gate_up_silu_fp8", "linear_residual_add_fp8",
    }
)  # fmt: skip
"""Ops whose reference function lives in ``llmc.cuda.reference_fp8``."""

OPS_WITHOUT_OUT = frozenset({"linear_residual_add", "linear_residual_add_fp8", "sample"})
"""Ops that take no ``out``: the residual is updated in place; sampled ids are the backend's."""


class Backend(Protocol):
    """Ops of one decoder forward step. Inputs are torch tensors on ``self.device``.

    Each op's parameters, shapes and meaning are those of its reference function in
    ``llmc.cuda.reference`` (one home for the contract; tests/cuda/test_reference_ops.py
    checks that every backend's methods take exactly those parameters). Every op but
    ``OPS_WITHOUT_OUT`` also takes an optional ``out`` (a view into the step's workspace
    arena from the engine's memory plan): when given, the result is written there and
    ``out`` returned (``add_rms_norm``: its normed result; rotated q may come back as a
    ``[T, nq, hd]`` view of it).
    """

    device: torch.device

    embedding: BackendOp  # ids [T] → [T, H]
    rms_norm: BackendOp  # x [T, H] → rms-normed x
    add_rms_norm: BackendOp  # residual += x in place → (rms_norm(residual), residual)
    linear: BackendOp  # x [T, in] @ weight [out, in].T (+ bias)
    rope_and_cache_write: BackendOp  # qkv → rotated q [T, nq, hd]; k, v into the cache
    attention: BackendOp  # q [T, nq, hd] → [T, nq * hd] over the paged cache
    silu_and_mul: BackendOp  # [T, 2I] gate | up → [T, I]
    # small-step fusions (needed only when ``fused_decode_max_tokens`` > 0)
    norm_linear: BackendOp  # linear(rms_norm(residual), weight, bias)
    norm_gate_up_silu: BackendOp  # silu_and_mul(linear(rms_norm(residual), gate_up))
    linear_residual_add: BackendOp  # residual += linear(x, weight) in place → residual
    sample: BackendOp  # logits [S, V] float32 → token ids [S] int64
    # FP8 (W8A8) engines: e4m3 weights with per-channel scales, activations quantized per
    # token by the op that produces them (llmc.cuda.reference_fp8; ``out`` is an Fp8Rows of
    # workspace views for the ops that return one)
    quantize_fp8: BackendOp  # x [T, K] → Fp8Rows (the o_proj input)
    rms_norm_fp8: BackendOp  # x [T, H] → Fp8Rows of rms_norm(x)
    add_rms_norm_fp8: BackendOp  # residual += x in place → (Fp8Rows of the norm, residual)
    silu_and_mul_fp8: BackendOp  # [T, 2I] → Fp8Rows of silu(gate) * up
    linear_fp8: BackendOp  # Fp8Rows [T, in] x e4m3 weight [out, in] → [T, out] in dtype
    norm_linear_fp8: BackendOp  # linear_fp8(rms_norm_fp8(residual), weight, scale, bias)
    norm_gate_up_silu_fp8: BackendOp  # silu_and_mul(linear_fp8(rms_norm_fp8(residual), gu))
    linear_residual_add_fp8: BackendOp  # residual += linear_fp8(quantize_fp8(x), w) in place


BACKEND_OPS: tuple[str, ...] = tuple(n for n in Backend.__annotations__ if n != "device")
"""Every op of the protocol, in the order of one forward step."""
