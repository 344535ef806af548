"""Pre-quantized FP8 HuggingFace checkpoints: their scale tensors (the ``quantization_config``
is read by fp8_scheme.py, without torch).

Layouts read (the ones people publish for Llama-family models):

- ``quant_method: fp8`` (AutoFP8 / NeuralMagic / Meta "FP8" repos): each quantized linear
  ``X.weight`` is float8_e4m3fn with a per-tensor ``X.weight_scale`` (a scalar) and, for
  static activation scales, an ``X.input_scale`` scalar;
- ``quant_method: compressed-tensors`` with ``format: float-quantized`` (llm-compressor's FP8
  and FP8-dynamic): 8-bit float weights, ``strategy`` tensor (scalar ``weight_scale``) or
  channel (``weight_scale`` [out, 1]);
- per-layer KV-cache scales ``self_attn.k_scale`` / ``self_attn.v_scale`` (also spelled
  ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``), scalars.

A real value of a quantized weight is ``code * weight_scale`` (per tensor or per output row),
so broadcasting a per-tensor scale to one value per output channel is exact: the ModelRunner
runs such a weight as the per-channel e4m3 weight llmc builds itself. ``input_scale`` is
validated and not used: llmc quantizes activations dynamically per token. A linear the
checkpoint leaves unquantized (its ``ignore`` list) is a float tensor like any other.

Refused, naming the tensor or the config field: an unknown ``quant_method`` or format, a
block-wise, grouped, integer or asymmetric scheme (UnsupportedError); a quantized weight
that is not e4m3 (e5m2: UnsupportedError) or holds NaN codes, or whose ``weight_scale`` is
missing, mis-shaped, zero, negative or not finite; a scale beside a tensor that is not a
quantized linear; half a k/v scale pair (CheckpointError).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.fp8_scheme import Fp8Scheme, is_scale_name
from llmc.compiler.spec import ModelSpec

_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PreQuantized:
    """The scales of a pre-quantized checkpoint, checked: per HF weight name its float32
    scale per output row [out] (per-tensor scales broadcast), per layer its (k, v) scales."""

    scheme: Fp8Scheme
    weight_scales: dict[str, torch.Tensor]
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)
    input_scales: int = 0
    """How many static input scales were validated (and are not used)."""
    per_channel: int = 0
    """How many of the weight scales were per output channel (the others per tensor)."""

    def note(self, quantization: str, dtype: str) -> str:
        """The build note: what was kept, what was dequantized, what is unused."""
        n = len(self.weight_scales)
        what = (
            f"pre-quantized FP8 checkpoint ({self.scheme.method}: {n - self.per_channel} "
            f"per-tensor and {self.per_channel} per-channel weight scales, "
            f"{self.scheme.activations})"
        )
        if quantization == "fp8":
            kept = f"{n} weights keep their e4m3 codes"
            if self.per_channel < n:
                kept += " (per-tensor scales broadcast per channel)"
        else:
            kept = f"{n} weights dequantized to {dtype} (--quantization none)"
        unused = (
            f"; {self.input_scales} static input_scale values validated, not used (llmc "
            "quantizes activations dynamically per token)"
            if self.input_scales
            else ""
        )
        return f"{what}: {kept}{unused}"


# ---- scale tensors ----------------------------------------------------------------------------
def quantizable_weights(spec: ModelSpec) -> list[str]:
    """HF names of the linears a checkpoint may store in FP8: the seven projections of every
    layer and lm_head (which llmc dequantizes: lm_head stays in the activation dtype)."""
    names = [
        f"model.layers.{n}.{m}.weight"
        for n in range(spec.num_layers)
        for m in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        )
    ]  # fmt: skip
    return names if spec.tie_word_embeddings else [*names, "lm_head.weight"]


def split_scales(
    spec: ModelSpec, scheme: Fp8Scheme, tensors: Mapping[str, torch.Tensor], source: str
) -> tuple[dict[str, torch.Tensor], PreQuantized]:
    """(the checkpoint's tensors without its scale tensors, the checked scales). The weights'
    names and shapes are validated by the caller, before this (``validate_hf_tensors``)."""
    weights = {k: v for k, v in tensors.items() if not is_scale_name(k)}
    scales = {k: v for k, v in tensors.items() if is_scale_name(k)}
    used: set[str] = set()
    weight_scales: dict[str, torch.Tensor] = {}
    inputs = per_channel = 0
    for name in quantizable_weights(spec):
        if name not in weights:
            continue  # the caller's validation names a missing weight
        base = name.removesuffix("weight")
        w, s = weights[name], scales.get(base + "weight_scale")
        used.add(base + "weight_scale")
        if w.dtype == torch.float8_e5m2:
            raise UnsupportedError(f"{source}: tensor {name!r} is float8_e5m2; only e4m3 is")
        if w.dtype != torch.float8_e4m3fn:
            if s is not None:
                raise CheckpointError(
                    f"{source}: tensor {base + 'weight_scale'!r} scales {name!r}, which is "
                    f"{str(w.dtype).removeprefix('torch.')}, not float8_e4m3fn"
                )
            continue  # left unquantized by the checkpoint (its ignore list)
        if s is None:
            raise CheckpointError(
                f"{source}: tensor {name!r} is float8_e4m3fn but its scale "
                f"{base + 'weight_scale'!r} is missing"
            )
        _check_codes(name, w, source)
        weight_scales[name] = _row_scales(base + "weight_scale", s, w.shape[0], source)
        per_channel += s.numel() > 1
        if base + "input_scale" in scales:
            used.add(base + "input_scale")
            _scalar(base + "input_scale", scales[base + "input_scale"], source)
            inputs += 1
    kv_scales = _kv_scales(spec, scales, used, source)
    stray = sorted(set(scales) - used)
    if stray:
        raise CheckpointError(
            f"{source}: unexpected tensor {stray[0]!r} (a scale of no quantized linear)"
        )
    return weights, PreQuantized(scheme, weight_scales, kv_scales, inputs, per_channel)


def _check_codes(name: str, w: torch.Tensor, source: str) -> None:
    """e4m3fn has no infinities; its NaN codes are 0x7F and 0xFF."""
    nan = (w.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        raise CheckpointError(
            f"{source}: tensor {name!r} holds {int(nan.sum())} NaN codes; the weight would be "
            "garbage"
        )


def _values(name: str, s: torch.Tensor, source: str) -> torch.Tensor:
    """Scale values as float32, each finite and > 0 (CheckpointError naming the tensor)."""
    if s.dtype not in _FLOAT_SCALE_DTYPES:
        raise CheckpointError(
            f"{source}: tensor {name!r} is {str(s.dtype).removeprefix('torch.')}; a scale must "
            "be float32, bfloat16 or float16"
        )
    v = s.float().reshape(-1)
    bad = ~(torch.isfinite(v) & (v > 0))
    if bool(bad.any()):
        first = float(v[bad.nonzero()[0, 0]])
        raise CheckpointError(
            f"{source}: tensor {name!r} holds {int(bad.sum())} scale(s) that are zero, negative "
            f"or not finite (e.g. {first:.6g}); a scale must be a positive finite number"
        )
    return v


def _row_scales(name: str, s: torch.Tensor, rows: int, source: str) -> torch.Tensor:
    """A per-tensor ([] or [1]) or per-channel ([out] or [out, 1]) scale → float32 [out]."""
    shape = tuple(s.shape)
    if shape not in ((), (1,), (rows,), (rows, 1)):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {list(shape)}; a weight scale is per tensor "
            f"([] or [1]) or per output channel ([{rows}] or [{rows}, 1])"
        )
    v = _values(name, s, source)
    return v.expand(rows).contiguous() if v.numel() == 1 else v.contiguous()


def _scalar(name: str, s: torch.Tensor, source: str) -> float:
    if tuple(s.shape) not in ((), (1,)):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {list(s.shape)}; expected a scalar ([] or [1])"
        )
    return float(_values(name, s, source)[0])


def _kv_scales(
    spec: ModelSpec, scales: Mapping[str, torch.Tensor], used: set[str], source: str
) -> dict[int, tuple[float, float]]:
    """Per layer (k_scale, v_scale) where the checkpoint has them: every layer or none."""
    out: dict[int, tuple[float, float]] = {}
    for n in range(spec.num_layers):
        a = f"model.layers.{n}.self_attn."
        pair = []
        for x in "kv":
            names = [a + f"{x}_scale", a + f"{x}_proj.output_scale"]
            found = [m for m in names if m in scales]
            used.update(found)
            pair.append(found[0] if found else None)
        if pair == [None, None]:
            continue
        if None in pair:
            have, lack = (pair[0], "v_scale") if pair[1] is None else (pair[1], "k_scale")
            raise CheckpointError(f"{source}: tensor {have!r} has no {lack} beside it")
        k, v = (_scalar(m, scales[m], source) for m in pair)
        out[n] = (k, v)
    if out and len(out) != spec.num_layers:
        lack = next(n for n in range(spec.num_layers) if n not in out)
        raise CheckpointError(
            f"{source}: KV-cache scales are given for {len(out)} of {spec.num_layers} layers; "
            f"'model.layers.{lack}.self_attn.k_scale' is missing"
        )
    return out
