"""Random weight-only ``PackedWeight``s (llmc.cuda.reference_wo) for the kernel tests: codes
uniform over every code, scales and offsets of the size a real quantizer gives (dequantized
weights of unit dot-product scale), f16 or f32, on any device."""

from __future__ import annotations

import torch

from llmc.cuda.reference_wo import PackedWeight, pack_codes


def random_packed(
    n: int,
    k: int,
    bits: int,
    group_size: int,
    *,
    offsets: bool,
    scale_dtype: torch.dtype = torch.float16,
    code_zero: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> PackedWeight:
    """A [n, k] PackedWeight; code_zero defaults to 0 with offsets (asymmetric, the offset
    is the group minimum) and to the middle code without (symmetric)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live (8B shapes)
    levels = 1 << bits
    if code_zero is None:
        code_zero = 0 if offsets else levels // 2
    codes = torch.randint(0, levels, (n, k), generator=g, device=device, dtype=torch.uint8)
    groups = (n, k // group_size)
    scales = (0.5 + torch.rand(groups, generator=g, device=device)) * (2.0 / levels) / k**0.5
    offs = None
    if offsets:
        spread = 0.8 + 0.4 * torch.rand(groups, generator=g, device=device)
        offs = (-(scales * levels / 2) * spread).to(scale_dtype)
    return PackedWeight(
        pack_codes(codes, bits), scales.to(scale_dtype), offs, bits, code_zero, group_size
    )
