"""RoPE cos/sin tables from a ModelSpec, matching HF transformers bit for bit.

The tables are ``[max_position, head_dim // 2]`` float32 (the half-tables; the rotate_half
form duplicates them, see ``llmc.cuda.backend``). They are always computed on the CPU
with the same float32 expressions as transformers' rotary embedding (default, ``linear``
and ``llama3`` rope types) and then moved to the device, so every backend and device reads
identical tables.
"""

from __future__ import annotations

import math

import torch

from llmc.base.errors import UnsupportedError
from llmc.compiler.spec import ModelSpec


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, incl. rope scaling (HF formulas)."""
    dim = spec.head_dim
    base = spec.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    rs = spec.rope_scaling
    if rs is None:
        return freqs
    if rs.kind == "linear":
        return freqs / rs.factor
    if rs.kind != "llama3":
        raise UnsupportedError(f"rope_scaling kind {rs.kind!r} is not supported (llama3, linear)")
    old_context_len = rs.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rs.low_freq_factor
    high_freq_wavelen = old_context_len / rs.high_freq_factor
    wavelen = 2 * math.pi / freqs
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / rs.factor, freqs)
    smooth = (old_context_len / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_tables(
    spec: ModelSpec, max_position: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position, head_dim // 2] float32 on ``device``."""
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq(spec)[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)
