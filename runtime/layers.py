"""DecoderLayers: the decoder layers of one forward step on a Backend, in the engine's dtype
or in FP8 (W8A8), each as the unfused op sequence and the fused small-step one.

The ModelRunner embeds the step's tokens into the ``residual`` workspace buffer, calls
``DecoderLayers.run`` and then applies the final norm and lm_head. Every op writes into a
view of the workspace arena (the memory plan's buffers); nothing is allocated here.

Op sequences per layer (the unfused path defers each residual add into the next add+norm,
so ``proj_out`` holds the last layer's down projection, not yet added, when ``run`` returns;
the fused path adds in place and leaves the residual complete):

- activation dtype, unfused: [add+]rms_norm → linear qkv → rope + KV write → attention →
  linear o_proj → add+rms_norm → linear gate_up → silu·mul → linear down;
- activation dtype, fused (``0 < T <= backend.fused_decode_max_tokens``): norm_linear qkv →
  rope + KV write → attention → linear_residual_add o_proj → norm_gate_up_silu →
  linear_residual_add down;
- fp8 weights, unfused: [add_]rms_norm_fp8 → linear_fp8 qkv → rope + KV write → attention →
  quantize_fp8 → linear_fp8 o_proj → add_rms_norm_fp8 → linear_fp8 gate_up →
  silu_and_mul_fp8 → linear_fp8 down (the quantized rows in ``normed_fp8``,
  ``attn_out_fp8``, ``act_fp8`` and their ``_scale`` buffers);
- fp8 weights, fused: norm_linear_fp8 qkv → rope + KV write → attention →
  linear_residual_add_fp8 o_proj → norm_gate_up_silu_fp8 → linear_residual_add_fp8 down;
- a mixed fp8 engine (``EngineLimits.float_projections``: ``--exclude_modules``): the fp8
  sequences, where each projection kept in the activation dtype (its scale None) runs the
  activation-dtype op of the same place instead, fed by the activation-dtype form of its
  producer (rms_norm into ``normed``, silu_and_mul into ``act``, attention's ``attn_out``
  unquantized; the fused ops take and give activation-dtype rows either way). The choice is
  made per layer and projection once, from the weights; CUDA graphs capture it as any op.

A weight-only engine (int8_wo, int4_wo, a GGUF kept native) runs the activation-dtype
sequences unchanged: its projections are ``PackedWeight``s, on which every backend op
dispatches (``llmc.cuda.reference_wo``).

Both paths of one engine compute the same values (``llmc.cuda.reference`` and
``llmc.cuda.reference_fp8`` compose the fused ops from the unfused ones). An fp8 KV cache
gets the layer's static (k_scale, v_scale), python floats read once at load, on
rope_and_cache_write and attention, and its smooth-K ``k_mean`` [nkv, hd] on
rope_and_cache_write only (attention is invariant to it); a 16/32-bit cache is called
exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from llmc.base.errors import EngineError
from llmc.compiler.limits import EngineLimits
from llmc.compiler.quantization import K_MEAN, KV_SCALE, SCALE_SUFFIX
from llmc.compiler.spec import ModelSpec
from llmc.cuda.backend import Backend
from llmc.cuda.reference_fp8 import Fp8Rows
from llmc.cuda.reference_wo import PackedWeight
from llmc.runtime.kv_tensors import KVCacheTensors
from llmc.runtime.step_inputs import StepInputs
from llmc.runtime.workspace import TORCH_DTYPES, Workspace

Weight = torch.Tensor | PackedWeight
"""A projection: a tensor, or a weight-only ``PackedWeight`` (int8_wo, int4_wo, GGUF)."""


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors (scales None in an engine without fp8 weights; the
    projections ``PackedWeight``s in a weight-only engine, run by the same op sequence)."""

    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    post_attn_norm: torch.Tensor
    gate_up: Weight
    down: Weight
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    kv_scales: tuple[float, ...] = ()
    """(k_scale, v_scale) for an fp8 KV cache; () otherwise (not passed). Positional: the
    TorchBackend's ops take only ``out`` by keyword."""
    k_mean: torch.Tensor | None = None
    """Smooth K's [nkv, hd] float32 for an fp8 KV cache (rope_and_cache_write's last
    positional argument); None otherwise."""


def _kv_scales(w: Mapping[str, Any], name: str) -> tuple[float, float]:
    k, v = (float(x) for x in w[name].tolist())
    for which, value in (("k_scale", k), ("v_scale", v)):
        if not (math.isfinite(value) and value > 0):
            raise EngineError(
                f"engine weights: tensor {name!r} holds {which} {value}; it must be a positive "
                "finite number"
            )
    return k, v


def _k_mean(w: Mapping[str, Any], name: str) -> torch.Tensor:
    m = w[name]
    if not bool(torch.isfinite(m).all()):
        raise EngineError(
            f"engine weights: tensor {name!r} (smooth K's mean of k) has non-finite values; "
            "recalibrate the engine (llmc calibrate) or rebuild it"
        )
    return m


def layer_weights(
    spec: ModelSpec, w: Mapping[str, Weight], limits: EngineLimits
) -> tuple[LayerWeights, ...]:
    """Each layer's tensors from the engine weights (checked by the caller; the packed ones
    already ``PackedWeight``s: ``ModelRunner._load_weights``), read once."""
    fp8_kv = limits.kv_cache_dtype == "fp8"
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        scale = {
            f"{x}_scale": w.get(p + proj + SCALE_SUFFIX)
            for x, proj in (("qkv", "qkv_proj"), ("o", "o_proj"), ("gate_up", "gate_up_proj"))
        }
        layers.append(
            LayerWeights(
                input_norm=w[p + "input_norm"],
                qkv=w[p + "qkv_proj"],
                qkv_bias=w.get(p + "qkv_bias"),
                o=w[p + "o_proj"],
                post_attn_norm=w[p + "post_attn_norm"],
                gate_up=w[p + "gate_up_proj"],
                down=w[p + "down_proj"],
                down_scale=w.get(p + "down_proj" + SCALE_SUFFIX),
                kv_scales=_kv_scales(w, p + KV_SCALE) if fp8_kv else (),
                k_mean=_k_mean(w, p + K_MEAN) if fp8_kv else None,
                **scale,
            )
        )
    return tuple(layers)


class DecoderLayers:
    """The layers of one model over one workspace, KV cache and RoPE tables."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, Weight],
        limits: EngineLimits,
        backend: Backend,
        kv_cache: KVCacheTensors,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        workspace: Workspace,
        reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``reduce`` (tensor parallelism: ``TPGroup.all_reduce``): sums o_proj's and
        down's partial outputs over the ranks, in place, before their residual add; only
        the unfused activation-dtype sequence runs then."""
        if reduce is not None and limits.quantization == "fp8":
            raise EngineError("tensor parallelism runs no fp8 engine")
        self.reduce = reduce
        self.spec, self.backend, self.kv_cache, self.ws = spec, backend, kv_cache, workspace
        self.cos, self.sin = cos_sin
        self.layers = layer_weights(spec, weights, limits)
        self.fp8 = limits.quantization == "fp8"
        self.dtype = TORCH_DTYPES[limits.dtype]

    def run(self, inp: StepInputs, fused: bool) -> None:
        """Every layer over the step's ``residual`` (see the module docstring)."""
        for i in self.pieces(inp, fused):
            self.attention(i, inp)

    def pieces(self, inp: StepInputs, fused: bool) -> Iterator[int]:
        """The layers' ops between their attentions: yields layer ``i`` when its rotated q
        is in the workspace's ``q`` and its K/V are written, for the caller to run
        ``attention(i, inp)``; the next ``next()`` runs the ops after it up to the next
        layer's attention (the last one: to the end of the layers). ``run`` is exactly
        that loop; the piecewise CUDA graphs (``llmc.runtime.piecewise_graphs``) capture
        each piece as one graph and run the attentions between them eagerly."""
        if self.fp8:
            yield from self._pieces_fp8(inp, fused)
        else:
            yield from self._pieces(inp, fused)

    def attention(self, i: int, inp: StepInputs, rows: int | None = None) -> None:
        """Layer ``i``'s attention: the workspace's rotated ``q`` → ``attn_out`` over
        ``inp.attn``, on ``rows`` rows (default the step's tokens; a piecewise graph's
        bucket: its padding rows come out as zeros or as they were)."""
        t = inp.num_tokens if rows is None else rows
        k_cache, v_cache = self.kv_cache.layer(i)
        qh = self.ws["q"][:t].view(t, self.spec.num_heads, self.spec.head_dim)
        kv = self.layers[i].kv_scales
        self.backend.attention(qh, k_cache, v_cache, inp.attn, *kv, out=self.ws["attn_out"][:t])

    def _rope_and_write(self, i: int, inp: StepInputs, qkv: torch.Tensor, q: torch.Tensor) -> None:
        """qkv → rotated q (into ``q``) and layer ``i``'s K/V written at the step's slots."""
        k_cache, v_cache = self.kv_cache.layer(i)
        lw = self.layers[i]
        meta, kv = inp.attn, lw.kv_scales
        smooth = () if lw.k_mean is None else (lw.k_mean,)
        self.backend.rope_and_cache_write(
            qkv, meta.positions, self.cos, self.sin, k_cache, v_cache, meta.slot_mapping, *kv,
            *smooth, out=q,
        )  # fmt: skip

    def _pieces(self, inp: StepInputs, fused: bool) -> Iterator[int]:
        be, ws, t = self.backend, self.ws, inp.num_tokens
        eps = self.spec.rms_norm_eps
        residual, normed = ws["residual"][:t], ws["normed"][:t]
        qkv, q, attn_out = ws["qkv"][:t], ws["q"][:t], ws["attn_out"][:t]
        proj_out, gate_up, act = ws["proj_out"][:t], ws["gate_up"][:t], ws["act"][:t]
        for i, lw in enumerate(self.layers):
            if fused:
                be.norm_linear(residual, lw.input_norm, eps, lw.qkv, lw.qkv_bias, out=qkv)
                self._rope_and_write(i, inp, qkv, q)
                yield i
                be.linear_residual_add(attn_out, lw.o, residual)
                be.norm_gate_up_silu(residual, lw.post_attn_norm, eps, lw.gate_up, out=act)
                be.linear_residual_add(act, lw.down, residual)
                continue
            if i == 0:
                be.rms_norm(residual, lw.input_norm, eps, out=normed)
            else:  # the previous layer's MLP residual add, fused with this layer's norm
                be.add_rms_norm(proj_out, residual, lw.input_norm, eps, out=normed)
            be.linear(normed, lw.qkv, lw.qkv_bias, out=qkv)
            self._rope_and_write(i, inp, qkv, q)
            yield i
            be.linear(attn_out, lw.o, out=proj_out)
            if self.reduce is not None:  # tensor parallelism: the ranks' partial sums
                self.reduce(proj_out)
            be.add_rms_norm(proj_out, residual, lw.post_attn_norm, eps, out=normed)
            be.linear(normed, lw.gate_up, out=gate_up)
            be.silu_and_mul(gate_up, out=act)
            be.linear(act, lw.down, out=proj_out)
            if self.reduce is not None:
                self.reduce(proj_out)

    def _rows(self, name: str, t: int) -> Fp8Rows:
        return Fp8Rows(self.ws[name][:t], self.ws[name + "_scale"][:t])

    def _pieces_fp8(self, inp: StepInputs, fused: bool) -> Iterator[int]:
        """The fp8 sequences, per projection: one whose scale is None (kept in the
        activation dtype: ``EngineLimits.float_projections``) runs the activation-dtype op
        in its place, fed by its producer's activation-dtype form (the norm into ``normed``,
        SiLU·mul into ``act``, the attention output as it is)."""
        be, ws, t, dt = self.backend, self.ws, inp.num_tokens, self.dtype
        eps = self.spec.rms_norm_eps
        residual, qkv, q, attn_out = (ws[n][:t] for n in ("residual", "qkv", "q", "attn_out"))
        proj_out, gate_up, act = ws["proj_out"][:t], ws["gate_up"][:t], ws["act"][:t]
        normed = ws["normed"][:t]
        n8, a8, m8 = (self._rows(n, t) for n in ("normed_fp8", "attn_out_fp8", "act_fp8"))
        for i, lw in enumerate(self.layers):
            if fused:
                self._fused_qkv_fp8(lw, residual, qkv, eps)
                self._rope_and_write(i, inp, qkv, q)
                yield i
                if lw.o_scale is None:
                    be.linear_residual_add(attn_out, lw.o, residual)
                else:
                    be.linear_residual_add_fp8(attn_out, lw.o, lw.o_scale, residual)
                self._fused_mlp_fp8(lw, residual, act, eps)
                continue
            x = n8 if lw.qkv_scale is not None else normed
            if i == 0:
                (be.rms_norm_fp8 if x is n8 else be.rms_norm)(residual, lw.input_norm, eps, out=x)
            else:  # the previous layer's MLP residual add, fused with this layer's norm
                add_norm = be.add_rms_norm_fp8 if x is n8 else be.add_rms_norm
                add_norm(proj_out, residual, lw.input_norm, eps, out=x)
            self._linear(x, lw.qkv, lw.qkv_scale, lw.qkv_bias, qkv)
            self._rope_and_write(i, inp, qkv, q)
            yield i
            if lw.o_scale is None:
                be.linear(attn_out, lw.o, out=proj_out)
            else:
                be.quantize_fp8(attn_out, out=a8)
                be.linear_fp8(a8, lw.o, lw.o_scale, None, dt, out=proj_out)
            x = n8 if lw.gate_up_scale is not None else normed
            add_norm = be.add_rms_norm_fp8 if x is n8 else be.add_rms_norm
            add_norm(proj_out, residual, lw.post_attn_norm, eps, out=x)
            self._linear(x, lw.gate_up, lw.gate_up_scale, None, gate_up)
            x = m8 if lw.down_scale is not None else act
            (be.silu_and_mul_fp8 if x is m8 else be.silu_and_mul)(gate_up, out=x)
            self._linear(x, lw.down, lw.down_scale, None, proj_out)

    def _linear(
        self,
        x: torch.Tensor | Fp8Rows,
        w: Weight,
        scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """``linear_fp8`` of e4m3 rows, or ``linear`` of a projection kept in dtype."""
        if scale is None:
            self.backend.linear(x, w, bias, out=out)
        else:
            self.backend.linear_fp8(x, w, scale, bias, self.dtype, out=out)

    def _fused_qkv_fp8(
        self, lw: LayerWeights, residual: torch.Tensor, qkv: torch.Tensor, eps: float
    ) -> None:
        """The fused small-step qkv op of an fp8 layer (its activation-dtype form for a qkv
        kept in dtype)."""
        be = self.backend
        if lw.qkv_scale is None:
            be.norm_linear(residual, lw.input_norm, eps, lw.qkv, lw.qkv_bias, out=qkv)
        else:
            be.norm_linear_fp8(
                residual, lw.input_norm, eps, lw.qkv, lw.qkv_scale, lw.qkv_bias, out=qkv
            )

    def _fused_mlp_fp8(
        self, lw: LayerWeights, residual: torch.Tensor, act: torch.Tensor, eps: float
    ) -> None:
        """The fused small-step MLP of an fp8 layer: gate_up and down each in fp8 or, kept
        in dtype, in their activation-dtype op (``act`` is in dtype either way)."""
        be = self.backend
        if lw.gate_up_scale is None:
            be.norm_gate_up_silu(residual, lw.post_attn_norm, eps, lw.gate_up, out=act)
        else:
            be.norm_gate_up_silu_fp8(
                residual, lw.post_attn_norm, eps, lw.gate_up, lw.gate_up_scale, out=act
            )
        if lw.down_scale is None:
            be.linear_residual_add(act, lw.down, residual)
        else:
            be.linear_residual_add_fp8(act, lw.down, lw.down_scale, residual)
