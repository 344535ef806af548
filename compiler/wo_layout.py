"""Weight-only layouts: which engine tensors are kept as ``PackedWeight``s, and how.

What it owns (no torch: the memory plan and ``llmc build --dry_run`` read it):

- ``WeightLayout``: the layout of one packed engine tensor (``llmc.cuda.reference_wo``):
  storage bits (4 or 8), ``code_zero``, ``group_size``, the scale dtype, whether it has
  offsets, and where it came from (``int8_wo``, ``int4_wo``, a GGUF type like ``Q4_1``);
- the engine tensors of one packed weight ``<name>`` [N, K]: ``<name>`` uint8 codes
  ([N, K/2] for 4 bits, [N, K] for 8), ``<name>_scale`` and ``<name>_offset`` [N, K/g]
  (``packed_tensor_shapes``);
- the layouts of a build: ``wo_layouts`` for ``--quantization int8_wo / int4_wo`` (the four
  projections of every layer; embedding, lm_head and norms stay in the activation dtype) and
  ``gguf_type_layout`` for a GGUF type kept native; ``unify_layouts``: the one layout the
  members of a fusion (q|k|v, gate|up) are rewritten in when theirs differ (the smallest
  group, 8-bit storage when one member needs it, the largest code_zero, float32 scales when
  one member has them, offsets when one member has them);
- ``check_group_size`` (``--group_size``: a power of two dividing K) and the manifest's
  ``quantization.layouts`` section, written by the build and parsed once by ``load_engine``
  (``layouts_from_manifest``: EngineError naming the tensor and field).

Invariant: a layout's group divides its tensor's K; a fused layout's codes stay below
``2**bits`` after the shift to the common code_zero (``unify_layouts`` refuses otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from llmc.base.errors import ConfigError, EngineError

WO_QUANTIZATIONS = ("int8_wo", "int4_wo")
"""Weight-only quantization of a float checkpoint at build (round-to-nearest)."""
GGUF_NATIVE = "gguf"
"""The engine keeps a GGUF file's quantized blocks (``compiler/gguf_blocks.py``)."""
WO_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
OFFSET_SUFFIX = "_offset"
SCALE_DTYPES = ("float16", "float32")
DEFAULT_GROUP_SIZE = 128

# GGUF types kept native: (storage bits, code_zero, group_size, scale dtype, offsets, max code)
GGUF_TYPES: dict[str, tuple[int, int, int, str, bool, int]] = {
    "Q8_0": (8, 128, 32, "float16", False, 255),
    "Q4_0": (4, 8, 32, "float16", False, 15),
    "Q4_1": (4, 0, 32, "float16", True, 15),
    "Q4_K": (4, 0, 32, "float32", True, 15),  # d·sc, -dmin·m: float32 products (as gguf)
    "Q5_K": (8, 0, 32, "float32", True, 31),  # 5-bit codes in bytes
    "Q6_K": (8, 32, 16, "float32", False, 63),  # 6-bit codes in bytes
}
KEPT_TYPES = tuple(GGUF_TYPES)  # the GGUF types llmc keeps packed (compiler/gguf_blocks.py)
GGUF_BLOCK_SIZES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


@dataclass(frozen=True)
class WeightLayout:
    """How one packed engine tensor is stored (the ``PackedWeight`` fields but the data)."""

    bits: int
    code_zero: int
    group_size: int
    scale_dtype: str = "float16"
    offsets: bool = False
    source: str = ""
    """What it was made from: 'int8_wo', 'int4_wo', or GGUF types ('Q4_K+Q6_K' fused)."""
    max_code: int = 255
    """The largest code the members store (a fused layout's shift check)."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits {self.bits}: must be 4 or 8")
        if not 0 <= self.code_zero < (1 << self.bits) or not 0 < self.max_code < (1 << self.bits):
            raise ValueError(f"code_zero {self.code_zero} / max_code {self.max_code}: not codes")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype {self.scale_dtype!r}: must be one of {SCALE_DTYPES}")
        if self.group_size <= 0:
            raise ValueError(f"group_size {self.group_size}: must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def bytes_of(self, n: int, k: int) -> int:
        """Bytes of codes, scales and offsets of an [n, k] weight."""
        scale = (2 if self.scale_dtype == "float16" else 4) * n * (k // self.group_size)
        return n * k * self.bits // 8 + scale * (2 if self.offsets else 1)


def check_group_size(group_size: Any, k: int | None = None, name: str = "") -> None:
    """ConfigError unless ``group_size`` is a power of two (>= 2) dividing ``k``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ConfigError(f"--group_size must be a power of two >= 2, got {group_size!r}")
    if group_size & (group_size - 1):
        raise ConfigError(f"--group_size {group_size} is not a power of two (e.g. 64, 128)")
    if k is not None and k % group_size:
        fit = group_size
        while k % fit:
            fit //= 2
        hint = f", e.g. --group_size {fit}" if fit >= 2 else " (K is odd: int4_wo needs an even K)"
        raise ConfigError(
            f"--group_size {group_size} does not divide K={k} of {name} (the input size of the "
            f"projection); choose a power of two that divides {k}{hint}"
        )


def wo_layouts(
    shapes: Mapping[str, tuple[int, ...]], quantization: str, group_size: int
) -> dict[str, WeightLayout]:
    """The layouts of an int8_wo / int4_wo engine over ``spec.tensor_shapes()``: every
    layer's four projections. int8_wo: codes 8-bit, code_zero 128, one group per row;
    int4_wo: asymmetric round-to-nearest in groups of ``group_size`` along K (codes 0..15,
    code_zero 0, float16 scale and offset = the group's minimum)."""
    if quantization not in WO_QUANTIZATIONS:
        return {}
    out: dict[str, WeightLayout] = {}
    for name, shape in shapes.items():
        if not (name.startswith("layers.") and name.rsplit(".", 1)[-1] in WO_PROJECTIONS):
            continue
        k = shape[1]
        if quantization == "int8_wo":
            out[name] = WeightLayout(8, 128, k, "float16", False, "int8_wo", 255)
        else:
            check_group_size(group_size, k, name)
            out[name] = WeightLayout(4, 0, group_size, "float16", True, "int4_wo", 15)
    return out


def gguf_type_layout(type_name: str) -> WeightLayout:
    """The layout a GGUF type is kept in (``GGUF_TYPES``)."""
    bits, zero, group, dt, off, top = GGUF_TYPES[type_name]
    return WeightLayout(bits, zero, group, dt, off, type_name, top)


def unify_layouts(layouts: list[WeightLayout]) -> WeightLayout:
    """The one layout that holds every member exactly: 8 bits if one member's codes need
    them, the smallest group (all are powers of two, so it divides every member's), the
    largest code_zero (each member's codes shift up by the difference), float32 scales if
    one member has them, offsets if one member has them (the others get -0.0, an exact
    identity of float addition). ValueError if a shifted code would not fit."""
    first = layouts[0]
    if all(x == first for x in layouts):
        return first
    zero = max(x.code_zero for x in layouts)
    top = max(x.max_code + zero - x.code_zero for x in layouts)
    bits = 4 if all(x.bits == 4 for x in layouts) and top < 16 else 8
    if top >= 1 << bits:
        raise ValueError(f"codes up to {top} do not fit {bits} bits")
    group = min(x.group_size for x in layouts)
    if any(x.group_size % group for x in layouts):
        raise ValueError(f"group sizes {[x.group_size for x in layouts]} do not nest")
    return WeightLayout(
        bits=bits,
        code_zero=zero,
        group_size=group,
        scale_dtype="float32" if any(x.scale_dtype == "float32" for x in layouts) else "float16",
        offsets=any(x.offsets for x in layouts),
        source="+".join(dict.fromkeys(x.source for x in layouts)),
        max_code=top,
    )


def packed_tensor_shapes(
    name: str, shape: tuple[int, ...], layout: WeightLayout
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The engine tensors of packed weight ``name`` [N, K] → (shape, dtype name)."""
    n, k = shape
    groups = (n, k // layout.group_size)
    out = {
        name: ((n, k // 2 if layout.bits == 4 else k), "uint8"),
        name + "_scale": (groups, layout.scale_dtype),
    }
    if layout.offsets:
        out[name + OFFSET_SUFFIX] = (groups, layout.scale_dtype)
    return out


def layouts_to_manifest(layouts: Mapping[str, WeightLayout]) -> dict[str, dict[str, Any]]:
    return {name: layout.to_dict() for name, layout in sorted(layouts.items())}


def layouts_from_manifest(
    manifest: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str
) -> dict[str, WeightLayout]:
    """The manifest's ``quantization.layouts`` → WeightLayouts, each checked against its
    tensor's shape (EngineError naming the tensor)."""
    section = manifest.get("quantization")
    raw = section.get("layouts", {}) if isinstance(section, dict) else {}
    if not isinstance(raw, dict):
        raise EngineError(f"{where}: quantization.layouts must be an object")
    out: dict[str, WeightLayout] = {}
    fields = set(WeightLayout.__dataclass_fields__)
    for name, d in raw.items():
        if name not in shapes or len(shapes[name]) != 2:
            raise EngineError(f"{where}: quantization.layouts names {name!r}, not a weight matrix")
        if not isinstance(d, dict) or set(d) != fields:
            raise EngineError(f"{where}: quantization.layouts[{name!r}] must hold {sorted(fields)}")
        try:
            layout = WeightLayout(**d)
        except (TypeError, ValueError) as e:
            raise EngineError(f"{where}: quantization.layouts[{name!r}]: {e}") from None
        ints = (layout.bits, layout.code_zero, layout.group_size, layout.max_code)
        if not all(type(v) is int for v in ints) or shapes[name][1] % layout.group_size:
            raise EngineError(
                f"{where}: quantization.layouts[{name!r}]: group_size {layout.group_size!r} "
                f"does not divide K={shapes[name][1]}"
            )
        out[name] = layout
    return out


def families(layouts: Mapping[str, WeightLayout], names: list[str]) -> dict[str, str]:
    """Tensor family (qkv_proj, embed_tokens …) → the layouts its tensors have, in words
    (the build report's and manifest's quantization per family); float tensors say so."""
    out: dict[str, set[str]] = {}
    for name in names:
        fam = name.rsplit(".", 1)[-1]
        lay = layouts.get(name)
        word = (
            "float"
            if lay is None
            else f"{lay.source}: {lay.bits}-bit storage, group {lay.group_size}, "
            f"{lay.scale_dtype} scales{' + offsets' if lay.offsets else ''}"
        )
        out.setdefault(fam, set()).add(word)
    return {fam: "; ".join(sorted(w)) for fam, w in out.items()}
