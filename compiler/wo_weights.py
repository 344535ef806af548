"""Weight-only weights in torch: the round-to-nearest quantizers of ``--quantization
int8_wo / int4_wo``, exact re-layout and fusion of ``PackedWeight``s, and the engine tensors
of one packed weight.

- ``quantize_int8_wo``: symmetric, one float16 scale per output channel (amax / 127),
  codes round(w / scale) + 128 (code_zero 128);
- ``quantize_int4_wo``: asymmetric, groups of ``group_size`` along K: offset = the group's
  minimum and scale = (max - min) / 15, both rounded to float16 first, then codes
  round((w - offset) / scale) clamped to 0..15 (code_zero 0). A weight with a non-finite
  value is refused naming it (CheckpointError): its group's scale would be garbage;
- ``relayout`` / ``fuse_packed``: a PackedWeight rewritten in another layout that holds it
  exactly (``wo_layout.unify_layouts``: wider storage, a smaller group, codes shifted to a
  larger code_zero, float32 scales, -0.0 offsets), so members of different layouts (a Q4_K
  q with a Q6_K v) concatenate along N into one weight that dequantizes to the same bits;
- ``packed_tensors`` / ``packed_from_tensors``: a PackedWeight ↔ its engine tensors
  ``<name>``, ``<name>_scale``, ``<name>_offset`` (``wo_layout.packed_tensor_shapes``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from llmc.base.errors import CheckpointError, EngineError
from llmc.compiler.wo_layout import OFFSET_SUFFIX, WeightLayout, unify_layouts
from llmc.cuda.reference_wo import PackedWeight, pack_codes

_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def _check_finite(name: str, w: torch.Tensor, source: str, what: str) -> None:
    finite = torch.isfinite(w)
    if not bool(finite.all()):
        raise CheckpointError(
            f"{source}: tensor {name!r} has {int((~finite).sum())} non-finite value(s) (NaN or "
            f"inf); it cannot be quantized to {what} (its scales would be garbage)"
        )


def quantize_int8_wo(w: torch.Tensor, name: str = "weight", source: str = "") -> PackedWeight:
    """A float [N, K] → int8_wo (module docstring)."""
    w = w.to(torch.float32)
    _check_finite(name, w, source, "int8_wo")
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16)
    s = scale.to(torch.float32)
    q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
    return PackedWeight((q + 128).to(torch.uint8), scale, None, 8, 128, w.shape[1])


def quantize_int4_wo(
    w: torch.Tensor, group_size: int, name: str = "weight", source: str = ""
) -> PackedWeight:
    """A float [N, K] → int4_wo in groups of ``group_size`` (module docstring)."""
    w = w.to(torch.float32)
    _check_finite(name, w, source, "int4_wo")
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    lo = g.amin(dim=2).to(torch.float16)
    scale = ((g.amax(dim=2) - lo.to(torch.float32)) / 15).to(torch.float16)
    s = scale.to(torch.float32)[..., None]
    q = torch.where(
        s > 0, torch.round((g - lo.to(torch.float32)[..., None]) / torch.where(s > 0, s, 1)), 0
    )
    codes = q.clamp(0, 15).reshape(n, k)
    return PackedWeight(pack_codes(codes, 4), scale, lo, 4, 0, group_size)


def quantize_wo(
    w: torch.Tensor, layout: WeightLayout, name: str = "weight", source: str = ""
) -> PackedWeight:
    """A float weight quantized to ``layout`` (an int8_wo or int4_wo one)."""
    if layout.source == "int8_wo":
        return quantize_int8_wo(w, name, source)
    return quantize_int4_wo(w, layout.group_size, name, source)


def layout_of(w: PackedWeight, source: str, max_code: int) -> WeightLayout:
    dt = str(w.scales.dtype).removeprefix("torch.")
    return WeightLayout(
        w.bits, w.code_zero, w.group_size, dt, w.offsets is not None, source, max_code
    )


def relayout(w: PackedWeight, layout: WeightLayout) -> PackedWeight:
    """``w`` in ``layout`` (which must hold it: ``unify_layouts``), dequantizing to the same
    bits: codes widened and shifted to layout.code_zero, each group's scale (and offset)
    repeated over the smaller groups, scales cast to float32 (exact), and offsets of -0.0
    where ``w`` had none (x + -0.0 == x for every float, -0.0 included)."""
    dt = _DTYPES[layout.scale_dtype]
    if w.group_size % layout.group_size or layout.code_zero < w.code_zero:
        raise ValueError(f"layout {layout} cannot hold a weight of group {w.group_size}")
    rep = w.group_size // layout.group_size
    codes = w.unpacked_codes() + (layout.code_zero - w.code_zero)
    if int(codes.max()) >= 1 << layout.bits:
        raise ValueError(f"codes up to {int(codes.max())} do not fit {layout.bits} bits")
    scales = w.scales.to(dt).repeat_interleave(rep, dim=1)
    offsets = None
    if layout.offsets:
        off = w.offsets if w.offsets is not None else torch.full_like(w.scales, -0.0)
        offsets = off.to(dt).repeat_interleave(rep, dim=1)
    return PackedWeight(
        pack_codes(codes, layout.bits), scales.contiguous(),
        None if offsets is None else offsets.contiguous(), layout.bits, layout.code_zero,
        layout.group_size,
    )  # fmt: skip


def fuse_packed(
    parts: list[tuple[PackedWeight, WeightLayout]],
) -> tuple[PackedWeight, WeightLayout]:
    """Members (with their layouts) concatenated along N in one exact layout."""
    layout = unify_layouts([lay for _, lay in parts])
    ws = [relayout(w, layout) if lay != layout else w for w, lay in parts]
    if len(ws) == 1:
        return ws[0], layout
    off = None if ws[0].offsets is None else torch.cat([w.offsets for w in ws])  # type: ignore[misc]
    fused = PackedWeight(
        torch.cat([w.codes for w in ws]), torch.cat([w.scales for w in ws]), off, layout.bits,
        layout.code_zero, layout.group_size,
    )  # fmt: skip
    return fused, layout


def permute_rows(w: PackedWeight, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedWeight:
    """``w`` with ``fn`` (a row permutation of an [N, ...] tensor) applied to codes, scales
    and offsets alike."""
    off = None if w.offsets is None else fn(w.offsets)
    return PackedWeight(fn(w.codes), fn(w.scales), off, w.bits, w.code_zero, w.group_size)


def packed_tensors(name: str, w: PackedWeight) -> dict[str, torch.Tensor]:
    """The engine tensors of packed weight ``name``."""
    out = {name: w.codes.contiguous(), name + "_scale": w.scales.contiguous()}
    if w.offsets is not None:
        out[name + OFFSET_SUFFIX] = w.offsets.contiguous()
    return out


def packed_from_tensors(
    tensors: Mapping[str, torch.Tensor], name: str, layout: WeightLayout
) -> PackedWeight:
    """The PackedWeight of engine tensor ``name`` (shapes and dtypes checked by the caller
    against ``engine_tensors``)."""
    try:
        return PackedWeight(
            tensors[name], tensors[name + "_scale"], tensors.get(name + OFFSET_SUFFIX),
            layout.bits, layout.code_zero, layout.group_size,
        )  # fmt: skip
    except ValueError as e:
        raise EngineError(f"engine weights: tensor {name!r}: {e}") from None
