"""The ``quantization_config`` of a pre-quantized FP8 HuggingFace checkpoint (config.json only,
no tensors: ``llmc build --dry_run`` reads it without loading torch).

Read: ``quant_method: fp8`` (AutoFP8 / NeuralMagic / Meta "FP8" repos: per-tensor e4m3 weight
scales, static or dynamic activation scales) and ``quant_method: compressed-tensors`` with
``format: float-quantized`` (llm-compressor's FP8 and FP8-dynamic: tensor or channel weight
strategies). Refused, naming the config field: an unknown ``quant_method`` or format, a
block-wise, grouped, integer or asymmetric scheme (UnsupportedError); a malformed section
(CheckpointError). The scale tensors themselves are fp8_checkpoint.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import CheckpointError, UnsupportedError, did_you_mean

METHODS = ("fp8", "compressed-tensors")
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".output_scale")
"""Names of the tensors a pre-quantized checkpoint adds beside its weights."""


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says (validated)."""

    method: str  # 'fp8' | 'compressed-tensors'
    activations: str  # in words, for the build notes


# ---- quantization_config ---------------------------------------------------------------------
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


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)
