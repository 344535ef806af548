"""GGUF-native engines: which engine tensors keep the file's quantized blocks, in which
layout, and which are dequantized and why — decided from the header alone (no tensor data),
so ``llmc build --dry_run`` plans the same bytes the build writes.

``native_plan(header, spec)`` walks ``weight_passes.fusion_table``: an engine tensor is kept
packed when every GGUF tensor it fuses is of a kept type (``wo_layout.KEPT_TYPES``); the
members' layouts (``wo_layout.gguf_type_layout``) are unified exactly when they differ
(``wo_layout.unify_layouts``). Otherwise it is dequantized to the activation dtype as a
``--quantization none`` build does, and ``NativePlan.dequantized`` names the tensor and the
reason (a type llmc does not keep, or a float member that cannot join a packed fusion).
Norms, biases and tensors the file stores in float stay float (not reported: nothing is
lost). What ``--quantization`` means for a GGUF source is ``check_gguf_quantization``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.base.errors import UnsupportedError
from llmc.compiler.gguf_header import GGUFHeader, type_name
from llmc.compiler.gguf_reader import ROPE_FREQS, hf_tensor_name
from llmc.compiler.spec import ModelSpec
from llmc.compiler.wo_layout import KEPT_TYPES, WeightLayout, gguf_type_layout, unify_layouts

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class NativePlan:
    """What a GGUF-native build keeps (engine name → layout) and dequantizes (→ why)."""

    layouts: dict[str, WeightLayout]
    member_layouts: dict[str, WeightLayout]
    """HF tensor name → the layout of its own type (before fusion)."""
    keep: frozenset[str]
    """The GGUF tensor names read as PackedWeights."""
    dequantized: dict[str, str] = field(default_factory=dict)
    file_tensor_bytes: int = 0
    types: dict[str, str] = field(default_factory=dict)
    """GGUF tensor name → its ggml type name."""

    @property
    def quantized(self) -> bool:
        """The file holds a quantized (non-float) tensor."""
        return any(t not in FLOAT_TYPES for t in self.types.values())


def check_types(header: GGUFHeader, types: dict[str, str]) -> None:
    """UnsupportedError naming the first tensor of a type llmc can neither keep nor
    dequantize (``gguf.quants`` has no dequantization for it), with the supported types;
    from the header, before any tensor is read (a dry run refuses it too)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    for kind in sorted(set(types.values()) - set(KEPT_TYPES) - {"F32", "F16"}):
        qtype = GGMLQuantizationType[kind]
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
        except NotImplementedError:
            name = next(n for n, k in types.items() if k == kind)
            raise UnsupportedError(
                f"{header.path}: tensor {name!r} has ggml type {kind}, which llmc cannot read; "
                f"supported: {', '.join(KEPT_TYPES)} (kept packed), F32, F16, BF16 and the "
                "other types gguf.quants dequantizes (Q5_0, Q5_1, Q2_K, Q3_K, IQ*, TQ*: "
                "dequantized to --dtype)"
            ) from None


def native_plan(header: GGUFHeader, spec: ModelSpec) -> NativePlan:
    """The GGUF-native layouts of ``header``'s model (module docstring)."""
    from llmc.compiler.weight_passes import fusion_table

    by_hf = {hf_tensor_name(t.name, header.path): t for t in header.tensors if t.name != ROPE_FREQS}
    types = {t.name: type_name(t.ggml_type) for t in header.tensors}
    check_types(header, types)
    shapes = spec.tensor_shapes()
    layouts: dict[str, WeightLayout] = {}
    members: dict[str, WeightLayout] = {}
    keep: set[str] = set()
    dequantized: dict[str, str] = {}
    for name, parts in fusion_table(spec).items():
        if name not in shapes or len(shapes[name]) != 2:
            continue  # norms, biases
        infos = [by_hf[p] for p in parts]
        kinds = [types[i.name] for i in infos]
        if all(k in FLOAT_TYPES for k in kinds):
            continue
        odd = [(i.name, k) for i, k in zip(infos, kinds, strict=True) if k not in KEPT_TYPES]
        if odd:
            what = ", ".join(f"{n} is {k}" for n, k in odd)
            why = (
                "float members cannot join a packed fusion exactly"
                if all(k in FLOAT_TYPES for _, k in odd)
                else f"llmc keeps {', '.join(KEPT_TYPES)} packed"
            )
            dequantized[name] = f"{what} ({why}); dequantized to the activation dtype"
            continue
        own = [gguf_type_layout(k) for k in kinds]
        try:
            layouts[name] = unify_layouts(own)
        except ValueError as e:  # cannot happen for the kept types; said, not hidden
            dequantized[name] = f"{', '.join(kinds)} have no common exact layout ({e})"
            continue
        members.update(zip(parts, own, strict=True))
        keep.update(i.name for i in infos)
    return NativePlan(
        layouts, members, frozenset(keep), dequantized,
        sum(t.nbytes for t in header.tensors), types,
    )  # fmt: skip


def resolve_gguf_quantization(asked: str, plan: NativePlan | None, source: str) -> str:
    """The engine's quantization for ``--quantization asked``. ``plan``: the GGUF source's
    native plan (None: not a GGUF). auto keeps a quantized GGUF's blocks (gguf), else none;
    none / fp8 dequantize a GGUF as before; int8_wo / int4_wo on a GGUF that is already
    quantized are refused (re-quantizing quantized values rounds twice: keep its blocks
    with the default, or dequantize it with none)."""
    quantized = plan is not None and plan.quantized
    if asked == "auto":
        return "gguf" if quantized else "none"
    if asked in ("int8_wo", "int4_wo") and quantized:
        assert plan is not None
        kinds = sorted({t for t in plan.types.values() if t not in FLOAT_TYPES})
        raise UnsupportedError(
            f"{source}: --quantization {asked} re-quantizes weights that are already quantized "
            f"({', '.join(kinds)}); leave --quantization at its default (auto keeps the file's "
            "blocks as they are) or pass --quantization none to dequantize them"
        )
    return asked
