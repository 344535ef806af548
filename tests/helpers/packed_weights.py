"""Random weight-only ``PackedWeight``s (llmc.cuda.reference_wo) for the kernel tests: codes
uniform over every code, scales and offsets of the size a real quantizer gives (dequantized
weights of unit dot-product scale), f16 or f32, on any device; ``WO_LAYOUTS``, every layout
the engines write, and ``layout_packed`` (one of them drawn at random)."""

from __future__ import annotations

import torch

from llmc.cuda.reference_wo import PackedWeight, pack_codes

F16, F32 = torch.float16, torch.float32
# name -> (bits, group_size (0 = K), offsets, scale dtype, code_zero (None = default));
# the comments name the scale mode gemv_wo.cu takes for each
WO_LAYOUTS = {
    "int4_g128_asym": (4, 128, True, F16, None),  # int4_wo default (kstep + sums)
    "int4_g128_sym": (4, 128, False, F16, 8),
    "int4_gK": (4, 0, False, F16, 8),  # row mode
    "int8_perchannel": (8, 0, False, F16, 128),  # int8_wo (row mode)
    "int8_g64_asym": (8, 64, True, F32, 0),  # kstep + sums
    "q8_0": (8, 32, False, F16, 128),  # deq
    "q4_0": (4, 32, False, F16, 8),
    "q4_1": (4, 32, True, F16, 0),
    "q4_k": (4, 32, True, F32, 0),
    "q5_k": (8, 32, True, F32, 0),
    "q6_k": (8, 16, False, F32, 32),
    "int4_g16_asym": (4, 16, True, F16, 0),  # deq: two groups per code vector
}


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


def layout_packed(
    name: str, rows: int, k: int, seed: int = 0, device: torch.device | str = "cpu"
) -> PackedWeight:
    """A random [rows, k] PackedWeight of ``WO_LAYOUTS[name]`` (group size 0: K)."""
    bits, gs, offs, sdt, cz = WO_LAYOUTS[name]
    return random_packed(
        rows, k, bits, gs or k, offsets=offs, scale_dtype=sdt, code_zero=cz, seed=seed,
        device=device,
    )  # fmt: skip
