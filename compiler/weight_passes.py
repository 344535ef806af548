"""Weight passes: HF tensor names → the engine's execution layout (see compiler/spec.py).

Fuses Q/K/V (and their biases) into one matrix, gate/up into one matrix (``fusion_table``),
casts to the engine dtype and makes every tensor contiguous. Validates the checkpoint
against the ModelSpec first: a missing, unexpected or mis-shaped tensor is a CheckpointError
naming it (expected vs got). The fused tensors are exact concatenations: fused ==
cat(originals) bit for bit after the same cast.

FP8 engines (``llmc.compiler.quantization``): the projections are quantized per output
channel at build (``quantize_projection``, which refuses a weight with non-finite values),
or keep a pre-quantized checkpoint's codes (``llmc.compiler.fp8_checkpoint``); dummy weights
are quantized at load (``quantize_engine_weights``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from llmc.base.errors import CheckpointError
from llmc.compiler.quantization import K_MEAN, KV_SCALE, SCALE_SUFFIX, stores_fp8
from llmc.compiler.spec import ModelSpec
from llmc.compiler.wo_layout import OFFSET_SUFFIX, WeightLayout
from llmc.compiler.wo_weights import fuse_packed, packed_from_tensors, packed_tensors, quantize_wo
from llmc.cuda.reference_fp8 import quantize_weight_fp8
from llmc.cuda.reference_wo import PackedWeight

if TYPE_CHECKING:
    from llmc.compiler.fp8_checkpoint import PreQuantized

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


def fusion_table(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Engine tensor → the HF tensors it concatenates along dim 0, in order (one home of the
    fusion: q | k | v, gate | up; every other engine tensor is one HF tensor)."""
    table: dict[str, tuple[str, ...]] = {"embed_tokens": ("model.embed_tokens.weight",)}
    for n in range(spec.num_layers):
        p, e = f"model.layers.{n}.", f"layers.{n}."
        a = p + "self_attn."
        table[e + "input_norm"] = (p + "input_layernorm.weight",)
        table[e + "qkv_proj"] = tuple(a + f"{x}_proj.weight" for x in "qkv")
        if spec.qkv_bias:
            table[e + "qkv_bias"] = tuple(a + f"{x}_proj.bias" for x in "qkv")
        table[e + "o_proj"] = (a + "o_proj.weight",)
        table[e + "post_attn_norm"] = (p + "post_attention_layernorm.weight",)
        table[e + "gate_up_proj"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        table[e + "down_proj"] = (p + "mlp.down_proj.weight",)
    table["final_norm"] = ("model.norm.weight",)
    if not spec.tie_word_embeddings:
        table["lm_head"] = ("lm_head.weight",)
    return table


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0).contiguous()


def to_engine_weights(
    spec: ModelSpec,
    hf: Mapping[str, torch.Tensor | PackedWeight],
    dtype: str,
    source: str = "checkpoint",
    *,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    prequantized: PreQuantized | None = None,
    layouts: Mapping[str, WeightLayout] | None = None,
    member_layouts: Mapping[str, WeightLayout] | None = None,
    float_projections: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Fuse and cast HF tensors into engine tensors (``quantization.engine_tensors``).
    ``float_projections``: the projections an fp8 engine keeps in ``dtype``
    (``--exclude_modules``; a pre-quantized checkpoint's float ones), cast like any other
    float tensor (a pre-quantized member dequantized first).

    ``layouts`` (engine name → layout): the weight-only packed tensors. Members that are
    ``PackedWeight``s (a GGUF's own blocks, each in ``member_layouts[hf name]``) are fused
    exactly (``wo_weights.fuse_packed``); float members (int8_wo / int4_wo) are fused, then
    quantized round-to-nearest (per row / per group: the same as quantizing each member).

    ``quantization='fp8'``: each projection is quantized per output channel from the
    checkpoint's own precision (``quantize_projection``), or, for a pre-quantized checkpoint
    (``prequantized``: its checked scales), keeps its e4m3 codes with per-channel scales;
    fusion concatenates codes and scales (exact, since scales are per row). With
    quantization 'none' a pre-quantized weight is dequantized (code × scale) and cast.
    ``kv_cache_dtype='fp8'`` adds each layer's kv_scale: the checkpoint's (k, v) scales, else
    (1.0, 1.0), and a zero k_mean (``kv_scale_tensors``)."""
    validate_hf_tensors(spec, {k: tuple(v.shape) for k, v in hf.items()}, source)
    dt = TORCH_DTYPES[dtype]
    scales = prequantized.weight_scales if prequantized is not None else {}

    def real(name: str) -> torch.Tensor:  # the HF tensor's values, in a float dtype
        w = hf[name]
        if name in scales:
            return w.float() * scales[name][:, None]
        if not w.dtype.is_floating_point or w.element_size() == 1:
            raise CheckpointError(
                f"{source}: tensor {name!r} is {str(w.dtype).removeprefix('torch.')}; llmc reads "
                "float32, float16 or bfloat16 weights (FP8 ones with a quantization_config)"
            )
        return w

    def fp8(name: str) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 codes, float32 [out])
        if name in scales:
            return hf[name], scales[name]
        return quantize_projection(name, real(name), source)

    layouts, member_layouts = layouts or {}, member_layouts or {}
    out: dict[str, torch.Tensor] = {}
    for name, parts in fusion_table(spec).items():
        if name in layouts:
            out.update(_packed(name, parts, hf, layouts[name], member_layouts, real, source))
        elif stores_fp8(name, quantization, float_projections):
            codes, row_scales = zip(*(fp8(p) for p in parts), strict=True)
            out[name] = _cat(list(codes))
            out[name + SCALE_SUFFIX] = _cat(list(row_scales))
        else:
            out[name] = _cat([real(p).to(dt) for p in parts])
    if kv_cache_dtype == "fp8":
        kv = prequantized.kv_scales if prequantized is not None else {}
        out.update(kv_scale_tensors(spec, kv))
    return out


def _packed(
    name: str,
    parts: tuple[str, ...],
    hf: Mapping[str, torch.Tensor | PackedWeight],
    layout: WeightLayout,
    member_layouts: Mapping[str, WeightLayout],
    real: Callable[[str], torch.Tensor],
    source: str,
) -> dict[str, torch.Tensor]:
    """The engine tensors of packed weight ``name`` (see ``to_engine_weights``)."""
    if all(isinstance(hf[p], PackedWeight) for p in parts):
        members = [(hf[p], member_layouts[p]) for p in parts]
        fused, got = fuse_packed(members)  # type: ignore[arg-type]
        if got != layout:
            raise CheckpointError(f"{source}: {name} fused to {got}, the plan says {layout}")
    else:
        fused = quantize_wo(_cat([real(p) for p in parts]), layout, name, source)
    return packed_tensors(name, fused)


def quantize_projection(
    name: str, weight: torch.Tensor, source: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] → (e4m3 [out, in], float32 scale [out]) per output channel
    (``llmc.cuda.reference_fp8.quantize_weight_fp8``). A weight with a NaN or infinite value
    is refused naming it (CheckpointError): its row's scale, and so every value of the row,
    would be garbage; with per-channel amax scaling no finite value overflows."""
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise CheckpointError(
            f"{source}: tensor {name!r} has {bad} non-finite value(s) (NaN or inf); it cannot "
            "be quantized to fp8 (its per-channel scales would be garbage). Fix the checkpoint"
        )
    return quantize_weight_fp8(weight)


def kv_scale_tensors(
    spec: ModelSpec, kv_scales: Mapping[int, tuple[float, float]]
) -> dict[str, torch.Tensor]:
    """``layers.{i}.kv_scale`` float32 [2] = (k_scale, v_scale): given, else (1.0, 1.0); and
    ``layers.{i}.k_mean`` float32 [nkv, hd], zero (smooth K off until ``llmc calibrate``: a
    checkpoint's k_scale was measured on k itself)."""
    out = {}
    for i in range(spec.num_layers):
        scales = kv_scales.get(i, (1.0, 1.0))
        out[f"layers.{i}.{KV_SCALE}"] = torch.tensor(scales, dtype=torch.float32)
        out[f"layers.{i}.{K_MEAN}"] = torch.zeros(spec.num_kv_heads, spec.head_dim)
    return out


def quantize_engine_weights(
    spec: ModelSpec,
    tensors: Iterable[tuple[str, torch.Tensor]],
    quantization: str,
    kv_cache_dtype: str,
    source: str,
    layouts: Mapping[str, WeightLayout] | None = None,
    float_projections: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Engine tensors in the activation dtype (e.g. dummy weights, consumed one at a time so
    each can be freed once quantized) → the engine tensors of ``quantization`` /
    ``kv_cache_dtype`` (kv scales 1.0) and of the weight-only ``layouts``; the
    ``float_projections`` of an fp8 engine stay as they are."""
    out: dict[str, torch.Tensor] = {}
    layouts = layouts or {}
    for name, t in tensors:
        if name in layouts:
            out.update(packed_tensors(name, quantize_wo(t, layouts[name], name, source)))
        elif stores_fp8(name, quantization, float_projections):
            out[name], out[name + SCALE_SUFFIX] = quantize_projection(name, t, source)
        else:
            out[name] = t
    if kv_cache_dtype == "fp8":
        out.update(kv_scale_tensors(spec, {}))
    return out


def dequantize_engine_weights(
    tensors: Mapping[str, torch.Tensor],
    dtype: str,
    layouts: Mapping[str, WeightLayout] | None = None,
) -> dict[str, torch.Tensor]:
    """An engine's tensors with every fp8 projection dequantized (code × scale, in ``dtype``)
    and every weight-only packed one (``layouts``) dequantized, with no scales or offsets:
    the values an unquantized model runs (the ``--peer hf`` model)."""
    dt = TORCH_DTYPES[dtype]
    layouts = layouts or {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((SCALE_SUFFIX, KV_SCALE, K_MEAN, OFFSET_SUFFIX)):
            continue
        if name in layouts:
            out[name] = packed_from_tensors(tensors, name, layouts[name]).dequantize().to(dt)
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        out[name] = t if scale is None else (t.float() * scale.float()[:, None]).to(dt)
    return out
