"""TorchBackend: the Backend protocol on plain torch ops (the reference; CPU and CUDA).

Every op is the function of the same name in ``llmc.cuda.reference``; when ``out`` (a view
of the step's workspace arena) is given the result is written there and ``out`` returned.
Matrix products and the embedding gather write straight into ``out`` (``torch.mm`` /
``torch.addmm`` / ``index_select`` with ``out=``); the other ops compute in float32
temporaries that torch allocates internally and copy the result into ``out``. That is the
accepted cost of a reference backend; the CUDA backend allocates nothing per step.

``fused_decode_max_tokens`` (default 0: off) lets CPU tests run the ModelRunner's fused
small-step op sequence (``norm_linear``, ``norm_gate_up_silu``, ``linear_residual_add``),
whose reference functions compose the unfused ops, so both sequences give the same bits.
"""

from __future__ import annotations

import torch

from llmc.base.errors import ConfigError
from llmc.cuda import reference as ref
from llmc.cuda.backend import AttentionMetadata, SamplingMetadata


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value.view(out.shape))
    return out


class TorchBackend:
    """The reference backend. ``device``: where inputs, weights and outputs live."""

    name = "torch"

    def __init__(
        self, device: torch.device | str = "cpu", fused_decode_max_tokens: int = 0
    ) -> None:
        n = fused_decode_max_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"fused_decode_max_tokens must be an integer >= 0, got {n!r}")
        self.device = torch.device(device)
        self.fused_decode_max_tokens = n

    def embedding(
        self, ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is None:
            return ref.embedding(ids, table)
        return torch.index_select(table, 0, ids, out=out)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _into(out, ref.rms_norm(x, weight, eps))

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = ref.add_rms_norm(x, residual, weight, eps)
        return _into(out, normed), residual

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            return ref.linear(x, weight, bias)
        if out.dtype != x.dtype:  # e.g. float32 logits from bfloat16 weights
            return _into(out, ref.linear(x, weight, bias))
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)

    def norm_linear(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _into(out, ref.norm_linear(residual, norm_weight, eps, weight, bias))

    def norm_gate_up_silu(
        self,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        gate_up_weight: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _into(out, ref.norm_gate_up_silu(residual, norm_weight, eps, gate_up_weight))

    def linear_residual_add(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        return ref.linear_residual_add(x, weight, residual)

    def rope_and_cache_write(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = ref.rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping)
        if out is None:
            return q
        out = out.view(q.shape)
        out.copy_(q)
        return out

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _into(out, ref.paged_attention(q, k_cache, v_cache, meta))

    def silu_and_mul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return ref.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return torch.mul(torch.nn.functional.silu(gate), up, out=out)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return ref.sample(logits, meta)
