"""What a build stores quantized, decided from headers before the memory plan: the packed
weight layouts (weight-only and GGUF-native), the float projections of a pre-quantized FP8
checkpoint (from its safetensors headers: the weights without a ``weight_scale`` stay in the
activation dtype), and the manifest's ``quantization`` section with its build notes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmc.compiler.build_config import BuildConfig
from llmc.compiler.exclude_modules import checkpoint_float_projections, member_modules
from llmc.compiler.fp8_scheme import read_scheme
from llmc.compiler.gguf_native import NativePlan, native_plan
from llmc.compiler.hf_reader import hf_tensor_shapes
from llmc.compiler.limits import EngineLimits
from llmc.compiler.memory_plan import MemoryPlan
from llmc.compiler.quantization import describe, family_dtypes
from llmc.compiler.resolve import ResolvedBuild
from llmc.compiler.spec import ModelSpec
from llmc.compiler.wo_layout import WeightLayout, families, layouts_to_manifest, wo_layouts

if TYPE_CHECKING:
    from llmc.compiler.fp8_checkpoint import PreQuantized


def quantization_notes(
    spec: ModelSpec,
    limits: EngineLimits,
    fp8: PreQuantized | None,
    fmt: str,
    wo: Mapping[str, Any],
    layouts: Mapping[str, WeightLayout],
) -> dict[str, Any]:
    """The manifest's ``quantization`` section (what the engine stores, in words, where its
    fp8 values came from, the projections kept in the activation dtype and each tensor
    family's dtypes, the weight-only part ``wo``: ``wo_section``) and the build notes
    about it."""
    kv_from = "from the checkpoint" if fp8 is not None and fp8.kv_scales else None
    section: dict[str, Any] = {
        "quantization": limits.quantization,
        "kv_cache_dtype": limits.kv_cache_dtype,
        **describe(limits, kv_from),
        "float_projections": list(limits.float_projections),
        "dtypes": family_dtypes(spec, limits, layouts),
        **wo,
    }
    notes = []
    if fp8 is not None:
        notes.append(fp8.note(limits.quantization, limits.dtype))
        if fp8.kv_scales and limits.kv_cache_dtype != "fp8":
            notes.append("the checkpoint's k/v scales are not used (--kv_cache_dtype auto)")
    for name, why in wo.get("dequantized", {}).items():
        notes.append(f"{name} dequantized: {why}")
    if limits.quantization == "fp8":
        if fmt == "dummy":
            section["source"] = "dummy weights, quantized per output channel when loaded"
        elif fp8 is not None:
            section["source"] = f"pre-quantized checkpoint ({fp8.scheme.method})"
        else:
            section["source"] = f"quantized per output channel at build from the {fmt} weights"
    return {"section": section, "notes": notes}


def gguf_native_plan(
    config: BuildConfig, spec: ModelSpec, model_config: object
) -> NativePlan | None:
    """The GGUF-native plan of a GGUF source (header only), else None."""
    from llmc.compiler.checkpoint import checkpoint_format

    if model_config is not None or config.checkpoint_dir is None:
        return None
    if config.load_format == "dummy" or checkpoint_format(config.checkpoint_dir) != "gguf":
        return None
    from llmc.compiler.gguf_header import read_gguf_header

    return native_plan(read_gguf_header(config.checkpoint_dir), spec)


def weight_layouts(
    spec: ModelSpec, limits: EngineLimits, group_size: int, native: NativePlan | None
) -> dict[str, WeightLayout]:
    """The packed engine tensors of the engine and their layouts (none for the projections
    ``--exclude_modules`` keeps in the activation dtype)."""
    if limits.quantization == "gguf":
        return dict(native.layouts) if native is not None else {}
    shapes = spec.tensor_shapes()
    kept = {n: s for n, s in shapes.items() if n not in limits.float_projections}
    return wo_layouts(kept, limits.quantization, group_size)


def scaled_weights(
    config: BuildConfig, hf_config: Mapping[str, Any], model_config: object
) -> frozenset[str] | None:
    """The HF weights a pre-quantized FP8 checkpoint stores in e4m3 (those with a
    ``weight_scale``), from its safetensors headers (no tensor data); None for any other
    source. ``split_scales`` checks at load that exactly these are e4m3."""
    if model_config is not None or config.checkpoint_dir is None or config.load_format == "dummy":
        return None
    from llmc.compiler.checkpoint import checkpoint_format

    if checkpoint_format(config.checkpoint_dir) != "hf":
        return None
    if read_scheme(hf_config, str(Path(config.checkpoint_dir) / "config.json")) is None:
        return None
    names = hf_tensor_shapes(config.checkpoint_dir)
    suffix = ".weight_scale"
    return frozenset(n.removesuffix("_scale") for n in names if n.endswith(suffix))


def with_checkpoint_floats(
    resolved: ResolvedBuild,
    notes: tuple[str, ...],
    spec: ModelSpec,
    scaled: frozenset[str] | None,
    source: str,
) -> tuple[ResolvedBuild, tuple[str, ...]]:
    """The build's settings with a pre-quantized FP8 checkpoint's float projections (those
    its ignore list left out: ``scaled`` lacks them) added to ``float_projections`` for an
    fp8 engine: they stay in the activation dtype, as the checkpoint says, instead of being
    quantized here. Decided before the plan, so a dry run plans the bytes the build writes."""
    lim = resolved.limits
    if scaled is None or lim.quantization != "fp8":
        return resolved, notes
    members = [n for names in member_modules(spec).values() for n in names]
    floats = [m + ".weight" for m in members if m + ".weight" not in scaled]
    extra = checkpoint_float_projections(spec, floats, source)
    merged = tuple(n for n in member_modules(spec) if n in {*lim.float_projections, *extra})
    if merged == lim.float_projections:
        return resolved, notes
    added = len(set(merged) - set(lim.float_projections))
    note = (
        f"{added} projection(s) the pre-quantized checkpoint leaves unquantized (its ignore "
        f"list) stay in {lim.dtype}"
    )
    limits = dataclasses.replace(lim, float_projections=merged)
    return dataclasses.replace(resolved, limits=limits), (*notes, note)


def wo_section(
    spec: ModelSpec,
    layouts: Mapping[str, WeightLayout],
    native: NativePlan | None,
    plan: MemoryPlan,
) -> dict[str, Any]:
    """The weight-only part of the manifest's quantization section: per-tensor layouts,
    the layout per tensor family, what a GGUF build dequantized and why, and the engine's
    weight bytes beside the file's."""
    out: dict[str, Any] = {
        "layouts": layouts_to_manifest(layouts),
        "families": families(layouts, list(spec.tensor_shapes())),
        "engine_weight_bytes": plan.weight_bytes_total,
    }
    if native is not None:  # a GGUF kept native
        out["dequantized"] = dict(native.dequantized)
        out["file_tensor_bytes"] = native.file_tensor_bytes
    return out
