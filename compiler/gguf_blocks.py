"""GGUF quantized blocks → ``PackedWeight``s in natural K order, bit-exact to gguf.

One converter per kept type (``CONVERTERS``: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), each
vectorised numpy over the raw bytes of a tensor ``[N, K]`` (N rows of K / block_size
blocks). Each reads its block with the same unpacking as ``gguf.quants``'s
``dequantize_blocks`` and keeps what it multiplies, so ``PackedWeight.dequantize()`` (float32:
``fl32(scale · (code - code_zero)) + offset``) gives exactly ``gguf.quants.dequantize``'s
values, bit for bit:

- Q8_0:  int8 x, f16 d per 32 → codes x + 128 (code_zero 128), scales d;
- Q4_0:  nibbles q, f16 d per 32 → codes q (code_zero 8), scales d (gguf: d·(q - 8));
- Q4_1:  nibbles q, f16 d, m per 32 → codes q, scales d, offsets m (gguf: d·q + m);
- Q4_K / Q5_K: 4/5-bit q per 256 with 6-bit (sc, m) per 32 and f16 (d, dmin) → scales
  fl32(d·sc), offsets -fl32(dmin·m) (gguf: fl32(d·sc)·q - fl32(dmin·m); x - y = x + (-y)
  exactly), float32 because the product does not fit float16;
- Q6_K:  6-bit q per 256 with int8 sc per 16 and f16 d → codes q (code_zero 32), scales
  fl32(d·sc) (gguf: fl32(d·sc)·(q - 32)).

The layout of each type is ``llmc.compiler.wo_layout.GGUF_TYPES``. A tensor whose K is not
a whole number of blocks, or whose bytes are not exactly its blocks, is refused
(CheckpointError naming the tensor): truncated blocks are never read past.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from llmc.base.errors import CheckpointError
from llmc.compiler.wo_layout import GGUF_BLOCK_SIZES, GGUF_TYPES
from llmc.cuda.reference_wo import PackedWeight, pack_codes

# (codes [nb, block] uint8, scales [nb, groups], offsets [nb, groups] | None)
Blocks = tuple[np.ndarray, np.ndarray, np.ndarray | None]
TYPE_SIZES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Q4_0 / Q4_1 [nb, 16] bytes → [nb, 32] codes: byte j holds elements j and j + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> Blocks:
    return b[:, 2:] ^ np.uint8(0x80), b[:, :2].copy().view(np.float16), None


def _q4_0(b: np.ndarray) -> Blocks:
    return _nibbles_32(b[:, 2:]), b[:, :2].copy().view(np.float16), None


def _q4_1(b: np.ndarray) -> Blocks:
    return (
        _nibbles_32(b[:, 4:]),
        b[:, :2].copy().view(np.float16),
        b[:, 2:4].copy().view(np.float16),
    )


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K / Q5_K → 8 six-bit (sc, m) (gguf's ``get_scale_min``)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (fl32(d·sc), -fl32(dmin·m)) per 32-element sub-block, [nb, 8]."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _low_high_32(qs: np.ndarray) -> np.ndarray:
    """[nb, 128] bytes → [nb, 256] nibbles: each 32-byte chunk holds sub-blocks 2c (low)
    and 2c + 1 (high)."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, QK_K)


def _q4_k(b: np.ndarray) -> Blocks:
    scales, offsets = _k_scales(b)
    return _low_high_32(b[:, 16:144]), scales, offsets


def _q5_k(b: np.ndarray) -> Blocks:
    scales, offsets = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (qh & 0x01).reshape(-1, QK_K)
    return _low_high_32(b[:, 48:176]) | (high << 4), scales, offsets


def _q6_k(b: np.ndarray) -> Blocks:
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    codes = (ql | (qh << 4)).reshape(-1, QK_K)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return codes, _f16(b[:, 208:210]) * sc, None


CONVERTERS: dict[str, Callable[[np.ndarray], Blocks]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def blocks_to_packed(
    raw: np.ndarray, shape: tuple[int, ...], type_name: str, name: str
) -> PackedWeight:
    """The raw bytes of GGUF tensor ``name`` ([N, K] in torch order, type ``type_name``)
    → its PackedWeight (module docstring). CheckpointError for a K that is not whole blocks
    or bytes that are not exactly the tensor's blocks."""
    block, size = GGUF_BLOCK_SIZES[type_name], TYPE_SIZES[type_name]
    if len(shape) != 2:
        raise CheckpointError(
            f"{name}: a {type_name} tensor kept quantized must be 2-D, got {list(shape)}"
        )
    n, k = shape
    if k % block:
        raise CheckpointError(
            f"{name}: {type_name} rows of {k} elements are not whole blocks of {block} "
            "(truncated blocks)"
        )
    want = n * (k // block) * size
    if raw.size != want:
        raise CheckpointError(
            f"{name}: {type_name} data is {raw.size} bytes, {n} x {k} needs {want} "
            "(truncated blocks)"
        )
    bits, code_zero, group, *_ = GGUF_TYPES[type_name]
    codes, scales, offsets = CONVERTERS[type_name](raw.reshape(-1, size))
    groups = (n, k // group)
    packed = pack_codes(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)), bits)
    return PackedWeight(
        codes=packed,
        scales=torch.from_numpy(np.ascontiguousarray(scales).reshape(groups)),
        offsets=None
        if offsets is None
        else torch.from_numpy(np.ascontiguousarray(offsets).reshape(groups)),
        bits=bits,
        code_zero=code_zero,
        group_size=group,
    )
