"""Pre-quantized FP8 HuggingFace checkpoints: their ``quantization_config`` and scale tensors.

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
from typing import Any

import torch

from llmc.base.errors import CheckpointError, UnsupportedError, did_you_mean
from llmc.compiler.spec import ModelSpec

METHODS = ("fp8", "compressed-tensors")
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".output_scale")
"""Names of the tensors a pre-quantized checkpoint adds beside its weights."""
_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says (validated)."""

    method: str  # 'fp8' | 'compressed-tensors'
    activations: str  # in words, for the build notes


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


# ---- quantization_config --------------------------------------------------------------------
def read_scheme(cfg: Mapping[str, Any], where: str) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme from config.json's ``quantization_config`` (None: absent);
    UnsupportedError for a method or scheme llmc does not load, CheckpointError when the
    section is malformed."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    where = f"{where}: quantization_config"
    if not isinstance(q, dict):
        raise CheckpointError(f"{where} must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if not isinstance(method, str):
        raise CheckpointError(f"{where}.quant_method must be a string, got {method!r:.60}")
    if method == "fp8":
        return _fp8_method(q, where)
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    raise UnsupportedError(
        f"{where}.quant_method {method[:60]!r} is not supported; llmc loads FP8 checkpoints "
        f"(quant_method {' or '.join(METHODS)}) and unquantized ones (or a GGUF, dequantized "
        "on import)" + did_you_mean(method, METHODS)
    )


def _fp8_method(q: dict[str, Any], where: str) -> Fp8Scheme:
    if q.get("weight_block_size") is not None:
        raise UnsupportedError(
            f"{where}.weight_block_size: block-wise FP8 scales are not supported (llmc runs "
            "per-tensor or per-channel weight scales)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedError(f"{where}.fmt {fmt!r:.60} is not supported; only e4m3 is")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise CheckpointError(
            f"{where}.activation_scheme must be static or dynamic, got {scheme!r:.60}"
        )
    return Fp8Scheme("fp8", f"{scheme} activation scales")


def _compressed_tensors(q: dict[str, Any], where: str) -> Fp8Scheme:
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise UnsupportedError(
            f"{where}.format {fmt!r:.60} is not supported; llmc loads compressed-tensors "
            "checkpoints in format float-quantized (FP8)"
        )
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}.config_groups must be a non-empty object")
    acts = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{str(name)[:40]}"
        if not isinstance(group, dict):
            raise CheckpointError(f"{at} must be an object")
        _fp8_args(group.get("weights"), f"{at}.weights", ("tensor", "channel"))
        a = group.get("input_activations")
        if a is not None:
            _fp8_args(a, f"{at}.input_activations", ("tensor", "token"), dynamic_ok=True)
            acts.add("dynamic" if a.get("dynamic") else "static")
    kv = q.get("kv_cache_scheme")
    if kv is not None:
        _fp8_args(kv, f"{where}.kv_cache_scheme", ("tensor",))
    activations = f"{'/'.join(sorted(acts)) or 'no'} activation scales"
    return Fp8Scheme("compressed-tensors", activations)


def _fp8_args(a: Any, at: str, strategies: tuple[str, ...], dynamic_ok: bool = False) -> None:
    """One compressed-tensors QuantizationArgs: 8-bit float, symmetric, a known strategy."""
    if not isinstance(a, dict):
        raise CheckpointError(f"{at} must be an object, got {type(a).__name__}")
    if a.get("type") != "float" or a.get("num_bits") != 8:
        raise UnsupportedError(
            f"{at}: type {a.get('type')!r:.30} with num_bits {a.get('num_bits')!r:.30} is not "
            "supported; llmc loads 8-bit float (FP8) schemes only"
        )
    strategy = a.get("strategy", "tensor")
    if strategy not in strategies:
        raise UnsupportedError(
            f"{at}.strategy {strategy!r:.40} is not supported (supported: {', '.join(strategies)})"
        )
    if a.get("symmetric", True) is not True:
        raise UnsupportedError(f"{at}: asymmetric (zero-point) FP8 is not supported")
    if a.get("dynamic", False) and not dynamic_ok:
        raise UnsupportedError(f"{at}: dynamic scales are not supported here")


# ---- scale tensors ----------------------------------------------------------------------------
def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


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
