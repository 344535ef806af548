"""Quantized engines: the two build settings, the engine tensor table with dtypes, and where
an FP8 engine may run.

What it owns (no torch: the memory plan and ``llmc build --dry_run`` read it):

- the meaning of ``--quantization`` (none, fp8; the weight-only int8_wo, int4_wo and the
  GGUF-native gguf, whose packed layouts are ``llmc.compiler.wo_layout``'s) and
  ``--kv_cache_dtype`` (auto = the activation dtype, fp8), vLLM's names (the values,
  ``QUANTIZATIONS`` and ``KV_CACHE_DTYPES``, are declared in compiler/limits.py beside
  ``EngineLimits``, whose fields they are);
- the FP8 recipe of an engine, W8A8: the four projections of every layer (``FP8_PROJECTIONS``)
  are stored in float8_e4m3fn with one float32 scale per output channel (``<name>_scale``
  [out]); activations are quantized per token, dynamically, by the op that produces them
  (``llmc.cuda.reference_fp8``); embedding, lm_head, norms and biases stay in the activation
  dtype. An fp8 KV cache stores e4m3 codes with one static (k_scale, v_scale) pair per
  layer, ``layers.{i}.kv_scale`` float32 [2] (1.0 unless the checkpoint brings calibrated
  scales), and smooth K's ``layers.{i}.k_mean`` float32 [nkv, hd], subtracted from the
  rotated k before it is quantized (SageAttention; softmax cancels it; zero until ``llmc
  calibrate`` measures it: ``llmc.runtime.kv_calibration``);
- ``engine_tensors``: every engine tensor of an engine → (shape, dtype), the table the
  build writes, ``load_engine`` and the ModelRunner check (``check_engine_tensors``: an
  EngineError naming the tensor) and the memory plan counts;
- ``check_fp8_target`` / ``check_fp8_gpu``: FP8 GEMMs need FP8 tensor cores (sm_89 or newer:
  Ada, Hopper); a target or GPU below is refused naming it and the flags that work.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from llmc.base.errors import EngineError, UnsupportedError, did_you_mean
from llmc.compiler.limits import EngineLimits
from llmc.compiler.spec import ModelSpec
from llmc.compiler.wo_layout import GGUF_TYPES, WeightLayout, packed_tensor_shapes

FP8 = "float8_e4m3fn"
FP8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The engine tensors of each layer an fp8 engine stores in e4m3 (``layers.{i}.<name>``)."""
SCALE_SUFFIX = "_scale"
KV_SCALE = "kv_scale"
K_MEAN = "k_mean"
FP8_MIN_SM = 89
"""The first compute capability with FP8 tensor cores (Ada sm_89; Hopper sm_90)."""

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, FP8: 1, "uint8": 1}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
Layouts = Mapping[str, WeightLayout]


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """UnsupportedError (with a did-you-mean) unless ``value`` is one of ``choices``."""
    if value not in choices:
        hint = did_you_mean(str(value), choices)
        head = str(value).split("_")[0]  # vLLM's fp8_e4m3 / fp8_e5m2 spellings
        if not hint and head in choices:
            hint = f" (did you mean {head!r}?)"
        raise UnsupportedError(
            f"{name} {value!r} is not supported; choose one of {', '.join(choices)}{hint}"
        )


def is_fp8_projection(name: str) -> bool:
    """``layers.{i}.<one of FP8_PROJECTIONS>``."""
    return name.startswith("layers.") and name.rsplit(".", 1)[-1] in FP8_PROJECTIONS


def stores_fp8(name: str, quantization: str, float_projections: Collection[str] = ()) -> bool:
    """Engine tensor ``name`` is stored in e4m3 (with a ``_scale``): a layer projection of an
    fp8 engine that ``float_projections`` (``EngineLimits.float_projections``) does not keep
    in the activation dtype."""
    return quantization == "fp8" and is_fp8_projection(name) and name not in float_projections


def kv_cache_dtype(limits: EngineLimits) -> str:
    """The KV pool's element dtype: float8_e4m3fn for an fp8 cache, else the activation's."""
    return FP8 if limits.kv_cache_dtype == "fp8" else limits.dtype


def kv_element_bytes(limits: EngineLimits) -> int:
    return ELEMENT_BYTES[kv_cache_dtype(limits)]


def engine_tensors(
    spec: ModelSpec, limits: EngineLimits, layouts: Layouts | None = None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every engine tensor → (shape, dtype name): ``spec.tensor_shapes()`` in the activation
    dtype; with fp8 weights the projections in e4m3 followed by their float32 scales [out];
    a weight-only packed tensor (``layouts``: int8_wo, int4_wo, GGUF kept native) as its
    uint8 codes, ``_scale`` and ``_offset`` (``wo_layout.packed_tensor_shapes``); with an fp8
    KV cache each layer's ``kv_scale`` float32 [2] = (k_scale, v_scale) and ``k_mean``
    float32 [nkv, hd] (smooth K)."""
    layouts = layouts or {}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    floats = limits.float_projections
    for name, shape in spec.tensor_shapes().items():
        if name in layouts:
            out.update(packed_tensor_shapes(name, shape, layouts[name]))
        elif stores_fp8(name, limits.quantization, floats):
            out[name] = (shape, FP8)
            out[name + SCALE_SUFFIX] = ((shape[0],), "float32")
        else:
            out[name] = (shape, limits.dtype)
    if limits.kv_cache_dtype == "fp8":
        for i in range(spec.num_layers):
            out[f"layers.{i}.{KV_SCALE}"] = ((2,), "float32")
            out[f"layers.{i}.{K_MEAN}"] = ((spec.num_kv_heads, spec.head_dim), "float32")
    return out


def family_dtypes(
    spec: ModelSpec, limits: EngineLimits, layouts: Layouts | None = None
) -> dict[str, dict[str, int]]:
    """Tensor family (``layers.{i}.`` dropped: ``qkv_proj``, ``down_proj_scale``, ...) → its
    dtypes → how many tensors have it (the manifest's and build report's dtype table)."""
    out: dict[str, dict[str, int]] = {}
    for name, (_, dt) in engine_tensors(spec, limits, layouts).items():
        family = name.split(".", 2)[-1] if name.startswith("layers.") else name
        counts = out.setdefault(family, {})
        counts[dt] = counts.get(dt, 0) + 1
    return out


def engine_tensor_bytes(
    spec: ModelSpec, limits: EngineLimits, layouts: Layouts | None = None
) -> dict[str, int]:
    """Bytes of every engine tensor (the memory plan's weights)."""
    tensors = engine_tensors(spec, limits, layouts).items()
    return {n: math.prod(shape) * ELEMENT_BYTES[dt] for n, (shape, dt) in tensors}


def check_engine_tensors(
    tensors: Mapping[str, Any],
    spec: ModelSpec,
    limits: EngineLimits,
    where: str,
    *,
    cast_ok: bool = False,
    layouts: Layouts | None = None,
) -> None:
    """Names, shapes and dtypes of ``tensors`` (torch tensors) against ``engine_tensors``:
    EngineError naming the first tensor that is missing, unexpected or of another shape or
    dtype than the engine's quantization says (a projection in ``limits.float_projections``
    in the activation dtype). ``cast_ok``: a 16/32-bit float tensor where the
    activation dtype is expected passes (the caller casts it); fp8 codes and scales never."""
    expected = engine_tensors(spec, limits, layouts)
    layouts = layouts or {}
    settings = f"quantization {limits.quantization}, kv_cache_dtype {limits.kv_cache_dtype}"
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise EngineError(f"{where}: tensor {missing[0]!r} is missing ({settings})")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise EngineError(f"{where}: unexpected tensor {unexpected[0]!r} ({settings})")
    in_dtype = {n: s for n, s in spec.tensor_shapes().items() if n not in layouts}
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        got = str(t.dtype).removeprefix("torch.")
        castable = cast_ok and name in in_dtype and dtype != FP8 and got in FLOAT_DTYPES
        if tuple(t.shape) != shape or (got != dtype and not (castable and got != FP8)):
            raise EngineError(
                f"{where}: tensor {name!r} is {list(t.shape)} {got}, expected {list(shape)} "
                f"{dtype} ({settings})"
            )


def check_float_layers(
    spec: ModelSpec, limits: EngineLimits, layouts: Layouts | None, where: str
) -> None:
    """An engine's ``float_projections`` name layers the model has and no packed tensor
    (EngineError: a manifest edited or from another model)."""
    layouts = layouts or {}
    for name in limits.float_projections:
        if int(name.split(".")[1]) >= spec.num_layers or name in layouts:
            why = "the model has no such layer" if name not in layouts else "it is packed"
            raise EngineError(f"{where}: float projection {name!r}: {why}")


def sm_number(arch: str) -> int | None:
    """90 for 'sm_90'; None for anything that is not a CUDA arch (cpu)."""
    if arch.startswith("sm_") and arch[3:].isdigit():
        return int(arch[3:])
    return None


def check_fp8_target(quantization: str, target: str) -> None:
    """fp8 weights for a CUDA target below sm_89 are refused at build time (UnsupportedError
    naming the target and the flags that build for it)."""
    sm = sm_number(target)
    if quantization == "fp8" and sm is not None and sm < FP8_MIN_SM:
        raise UnsupportedError(
            f"--quantization fp8 needs a GPU with FP8 tensor cores (sm_{FP8_MIN_SM} or newer: "
            f"Ada, Hopper), but the target is {target}; build for {target} with "
            f"--quantization none (--kv_cache_dtype fp8 works there), or choose --target "
            f"sm_89, sm_90 or cpu"
        )


def check_fp8_gpu(limits: EngineLimits, gpu_name: str, arch: str, fix: str) -> None:
    """An engine with fp8 weights on a GPU below sm_89 is refused (UnsupportedError naming
    the GPU and ``fix``, the build command that works there)."""
    sm = sm_number(arch)
    if limits.quantization == "fp8" and sm is not None and sm < FP8_MIN_SM:
        raise UnsupportedError(
            f"this engine has fp8 weights (W8A8), which need a GPU with FP8 tensor cores "
            f"(sm_{FP8_MIN_SM} or newer: Ada, Hopper); {gpu_name} is {arch}. Rebuild it with "
            f"--quantization none: {fix} (or run it on the torch reference backend: "
            "--backend torch)"
        )


def describe(limits: EngineLimits, kv_scales_from: str | None = None) -> dict[str, str]:
    """The engine's quantization in words (the manifest's ``quantization`` section and the
    build report): ``weights`` and ``kv_cache``. ``kv_scales_from``: where the fp8 KV
    scales came from (None: 1.0, no calibrated scales)."""
    dt = limits.dtype
    excluded = ""
    if limits.float_projections:
        n = len(limits.float_projections)
        excluded = f"; {n} projection(s) excluded, in {dt}: {', '.join(limits.float_projections)}"
    if limits.quantization == "fp8":
        weights = (
            f"fp8 W8A8: {', '.join(FP8_PROJECTIONS)} in {FP8} with one float32 scale per "
            f"output channel; activations quantized per token at run time (dynamic); "
            f"embedding, lm_head, norms and biases stay {dt}"
        )
    elif limits.quantization in ("int8_wo", "int4_wo"):
        weights = (
            f"{limits.quantization} weight-only: {', '.join(FP8_PROJECTIONS)} packed "
            f"(round-to-nearest; layouts per tensor below), activations {dt}; embedding, "
            f"lm_head, norms and biases stay {dt}"
        )
    elif limits.quantization == "gguf":
        weights = (
            f"gguf native: every tensor the file holds in a kept type ({', '.join(GGUF_TYPES)}) "
            f"packed, bit-exact to gguf.quants.dequantize; the rest, norms and biases {dt}; "
            f"activations {dt}"
        )
    else:
        weights = f"none: every tensor in {dt}"
    weights += excluded
    if limits.kv_cache_dtype == "fp8":
        scales = kv_scales_from or "1.0 (no calibrated scales in the checkpoint)"
        kv = (
            f"fp8: {FP8}, 1 byte per element, one k/v scale pair per layer: {scales}; "
            "smooth K: a per-layer k_mean [kv heads, head_dim] subtracted before quantizing "
            "(zero until llmc calibrate)"
        )
    else:
        kv = f"auto: {dt}, {ELEMENT_BYTES[dt]} bytes per element"
    return {"weights": weights, "kv_cache": kv}
