"""The torch reference of weight-only quantized weights: the ``PackedWeight`` layout, its
exact dequantization, and the linear / embedding arithmetic every backend must match.

One layout holds every weight-only format llmc keeps: int8 per channel and int4 in groups
(``--quantization int8_wo / int4_wo``) and the blocks of a GGUF file (Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K, Q6_K) rewritten in natural K order. A ``PackedWeight`` is a matrix
``[N, K]`` (nn.Linear layout: out, in) of unsigned codes in groups of ``group_size``
consecutive elements along K, with one scale (and optionally one additive offset) per
group:

    w[n, k] = fl32( fl32(scales[n, g] * float(codes[n, k] - code_zero)) + offsets[n, g] )
    with g = k // group_size, every operation in float32, each rounded once (no FMA),
    and the ``+ offsets`` step absent when ``offsets`` is None.

That formula is what ``gguf.quants.dequantize`` computes (numpy float32, d·q then + m), so
a GGUF tensor rewritten in this layout dequantizes to the same bits: Q4_1 and Q4_K/Q5_K
keep their minimum as ``offsets`` (Q4_K/Q5_K: ``-dmin·m`` and ``d·sc`` precomputed in
float32 per 32-element sub-block, as gguf does), Q4_0 / Q6_K / int8 keep their signed
codes as ``code - code_zero`` (8, 32, 128). ``code - code_zero`` is a small integer, exact
in float32.

Storage (``codes`` uint8): ``bits == 4``: ``[N, K // 2]``, two codes per byte, the even
k in the low nibble; ``bits == 8``: ``[N, K]``, one code per byte (5- and 6-bit GGUF codes
are stored in bytes). ``scales`` and ``offsets``: float16 or float32 ``[N, K //
group_size]`` (float32 where the source's product of scales does not fit float16).
``group_size`` divides K; rows are concatenated along N by fusion (q|k|v, gate|up) only
when all members share bits, code_zero, group_size and dtypes (the compiler unifies them
exactly before fusing).

Arithmetic: ``linear`` dequantizes to float32 and computes ``x @ w.T (+ bias)`` in
float32, rounded once to ``x.dtype``; ``embedding`` gathers code rows and dequantizes them
(float32; rounded once into the activation dtype of ``out``). CUDA kernels may accumulate
in another order and may fuse the scale and offset into one FMA: they match within the
tolerance of a float32-accumulated GEMM, while ``dequantize`` itself is the bit-exact
contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STORAGE_BITS = (4, 8)
SCALE_DTYPES = (torch.float16, torch.float32)


@dataclass(frozen=True)
class PackedWeight:
    """A weight-only quantized ``[N, K]`` matrix (see the module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    code_zero: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in STORAGE_BITS:
            raise ValueError(f"PackedWeight bits={self.bits}: must be one of {STORAGE_BITS}")
        if not 0 <= self.code_zero < (1 << self.bits):
            raise ValueError(f"PackedWeight code_zero={self.code_zero}: not a {self.bits}-bit code")
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 2:
            raise ValueError(f"PackedWeight codes: uint8 [N, K'] expected, got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")  # fmt: skip
        n, k = self.shape
        groups = (n, k // self.group_size) if self.group_size > 0 else None
        if groups is None or k % self.group_size:
            raise ValueError(f"PackedWeight group_size={self.group_size} does not divide K={k}")
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.dtype not in SCALE_DTYPES or tuple(t.shape) != groups:
                raise ValueError(f"PackedWeight {name}: float16/float32 {groups} expected, got "
                                 f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
        if self.offsets is not None and self.offsets.dtype != self.scales.dtype:
            raise ValueError("PackedWeight offsets must have the dtype of scales")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): the logical matrix."""
        n, width = self.codes.shape
        return n, width * 2 if self.bits == 4 else width

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same weight with its tensors on ``device``."""
        off = None if self.offsets is None else self.offsets.to(device)
        return PackedWeight(
            self.codes.to(device), self.scales.to(device), off, self.bits, self.code_zero,
            self.group_size,
        )  # fmt: skip

    def unpacked_codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The codes as int32 ``[N, K]`` (or of ``rows`` only)."""
        codes = self.codes if rows is None else self.codes.index_select(0, rows)
        return unpack_codes(codes, self.bits)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[N, K]`` (or ``[len(rows), K]``), bit-exact per the module formula."""
        q = (self.unpacked_codes(rows) - self.code_zero).to(torch.float32)
        n, k = q.shape
        q = q.view(n, k // self.group_size, self.group_size)  # [N, groups, g]
        scales = self.scales if rows is None else self.scales.index_select(0, rows)
        w = _per_element(scales) * q
        if self.offsets is not None:
            offsets = self.offsets if rows is None else self.offsets.index_select(0, rows)
            w = w + _per_element(offsets)
        return w.view(n, k)


def _per_element(groups: torch.Tensor) -> torch.Tensor:
    """[N, groups] → float32 [N, groups, 1], broadcast over each group's elements (the
    same one multiply / add per element as repeating it, without the copy)."""
    return groups.to(torch.float32)[..., None]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes ``[N, K]`` (any integer dtype, each < 2**bits) → the uint8 storage."""
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 storage → int32 codes ``[N, K]``."""
    c = codes.to(torch.int32)
    if bits == 8:
        return c
    return torch.stack((c & 0xF, c >> 4), dim=-1).reshape(c.shape[0], -1)


def linear_wo(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ dequantize(weight).T (+ bias) [T, N]: float32, rounded once to x.dtype."""
    y = x.to(torch.float32) @ weight.dequantize().T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def embedding_wo(ids: torch.Tensor, table: PackedWeight) -> torch.Tensor:
    """ids [T] → the dequantized rows [T, H] in float32 (the backend's ``out`` buffer, in
    the activation dtype, receives them rounded once)."""
    return table.dequantize(ids)
