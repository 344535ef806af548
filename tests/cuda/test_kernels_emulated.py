"""The FP8 kernels (and the attention kernels they extend) on the CPU, through the host
emulator (tests/helpers/cuda_emulator.py, tests/cuda/kernel_emulator.h): the kernel source
compiled as host C++, launched with CudaBackend's launch plans, against the references.

What the emulation checks: index math, tail and scalar paths, the software e4m3 encoder
(the path below sm_89; the GPU tests check the cvt.rn.satfinite path) and mma fragment
layouts (validated on prefill_attention.cu's bf16 kernel, which the GPU tests verify).
Codes are compared bit for bit where the recipe is deterministic (llmc.cuda.reference_fp8):
quantize_fp8 against the reference itself; rms_norm_fp8 / silu_and_mul_fp8 against the
reference recipe applied to the emulated BF16 kernel's output (same sums, same values); the
fp8 KV write against the reference. Attention within bf16 tolerance of the reference on the
same fp8 cache. Skipped where g++ is missing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers.attention import paged_batch, rel_err, rope_tables
from helpers.cuda_emulator import EmulatedFamily, emulator_missing
from llmc.cuda import reference as ref
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.kernels import KernelConfig
from llmc.cuda.launch_args import rms_block, row_block

pytestmark = [
    pytest.mark.skipif(emulator_missing(), reason="g++ not on PATH"),
    pytest.mark.slow,
]

E4M3 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
CFG = {
    "float32": KernelConfig("float32", 16, 4, 2),
    "bfloat16": KernelConfig("bfloat16", 64, 9, 3),
    "float16": KernelConfig("float16", 16, 4, 2),
}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# decode attention also at head_dim 128 with 8 query heads per kv head (the tensor-core
# pass's largest group; bf16: 16-bit mma, fp8 cache: fp16 mma; hd 16 fp8: the CUDA-core pass)
CFG_G8 = KernelConfig("bfloat16", 128, 16, 2)
# (family, kernel, arguments)
KERNELS = [
    ("quantize", "quantize_fp8_kernel", 6),
    ("rmsnorm", "rms_norm_kernel", 9),
    ("rmsnorm", "rms_norm_fp8_kernel", 10),
    ("activation", "silu_and_mul_kernel", 5),
    ("activation", "silu_and_mul_fp8_kernel", 6),
    ("rope_kv", "rope_kv_fp8_kernel", 13),
    ("decode_attention", "paged_attention_kernel", 19),
    ("decode_attention", "paged_attention_fp8_kernel", 19),
    ("prefill_attention", "prefill_attention_kernel", 12),
    ("prefill_attention", "prefill_attention_fp8_kernel", 12),
]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """(dtype, kernel) -> launcher; one program per (config, family), all compiling at once."""
    tmp = tmp_path_factory.mktemp("kernel_emu")
    families: dict[str, dict[str, int]] = {}
    for fam, name, nargs in KERNELS:
        families.setdefault(fam, {})[name] = nargs
    out = {}
    for dt, cfg in [*CFG.items(), ("g8", CFG_G8)]:
        for fam, kernels in families.items():
            if (fam == "prefill_attention" and dt == "float32") or (
                dt == "g8" and fam != "decode_attention"
            ):
                continue
            prog = EmulatedFamily(fam, cfg, kernels, tmp)
            out.update({(dt, name): prog[name] for name in kernels})
    return out


def _codes(rows: ref8.Fp8Rows | torch.Tensor) -> torch.Tensor:
    q = rows.q if isinstance(rows, ref8.Fp8Rows) else rows
    return q.view(torch.uint8)


def _fp8_out(t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Poisoned e4m3 codes (0x7f = NaN) and scales."""
    q = torch.full((t, k), 0x7F, dtype=torch.uint8).view(E4M3)
    return q, torch.full((t,), math.nan)


def _unaligned(x: torch.Tensor) -> torch.Tensor:
    """A copy of x whose data pointer is one element past a 16-byte boundary."""
    buf = torch.empty(x.numel() + 16, dtype=x.dtype)
    off = (-(buf.data_ptr() // x.element_size()) % (16 // x.element_size())) + 1
    return buf[off : off + x.numel()].view_as(x).copy_(x)


def _rows(t: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random rows of very different magnitudes: zeros, tiny, large, huge."""
    mags = torch.tensor([1.0, 0.0, 1e-3, 300.0, 1e-30, 1e30, 7.0, 1e4])[torch.arange(t) % 8]
    if dtype == torch.float16:
        mags = mags.clamp(1e-4, 1e3) * (mags > 0)
    return (torch.randn(t, k, generator=g) * mags[:, None]).to(dtype)


def _quantize(emu, dt, x):
    t, k = x.shape
    q, s = _fp8_out(t, k)
    vec = 16 // x.element_size()
    vec_ok = k % vec == 0 and x.data_ptr() % 16 == 0
    emu[dt, "quantize_fp8_kernel"](
        (min(t, 65535),), row_block(k // vec if vec_ok else k, 4), x, q, s, t, k, int(vec_ok)
    )
    return ref8.Fp8Rows(q, s)


def test_software_e4m3_encoder_rounds_like_torch(emu):
    """A row whose amax is 448 has inv = 1: the codes are x's own. Every e4m3 value, the
    midpoints between neighbours (ties to even), values just off them, subnormals and zeros
    of both signs. (Saturation: the fp8 KV write below.)"""
    pos = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2
    below, above = mids * (1 - 2**-20), mids * (1 + 2**-20)
    vals = torch.cat([pos, mids, below, above, torch.tensor([2.0**-10, 2.0**-12, 1e-30])])
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0, 448.0])])
    x = vals.float()[None]
    got = _quantize(emu, "float32", x)
    want = ref8.quantize_fp8(x)
    assert want.scale.item() == 1.0 and got.scale.item() == 1.0
    assert torch.equal(_codes(got), _codes(want))


@pytest.mark.parametrize("dt", list(CFG))
@pytest.mark.parametrize(
    "t,k,aligned", [(9, 1000, True), (3, 577, True), (8, 64, False), (2, 40000, True)]
)
def test_quantize_fp8_bit_exact(emu, dt, t, k, aligned):
    g = torch.Generator().manual_seed(t * 7 + k)
    x = _rows(t, k, TORCH[dt], g)
    if not aligned:
        x = _unaligned(x)
    got = _quantize(emu, dt, x)
    want = ref8.quantize_fp8(x)
    assert torch.equal(_codes(got), _codes(want))
    assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("dt", list(CFG))
@pytest.mark.parametrize(
    "t,h,aligned", [(5, 1000, True), (3, 577, True), (4, 64, False), (2, 40000, True)]
)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fp8_is_the_recipe_on_rms_norm(emu, dt, t, h, aligned, residual):
    g = torch.Generator().manual_seed(h + t + residual)
    dtype = TORCH[dt]
    x = _rows(t, h, dtype, g).clamp(-1e4, 1e4)
    x[1] = 0  # a zero row: rms = sqrt(eps), every value 0, finite scale
    w = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype) if residual else x
    if not aligned:
        x, res = _unaligned(x), _unaligned(res)
    vec = 16 // x.element_size()
    vec_ok = h % vec == 0 and x.data_ptr() % 16 == 0
    block = rms_block(h, vec, vec_ok)
    res8, res16 = res.clone(), res.clone()
    q, s = _fp8_out(t, h)
    emu[dt, "rms_norm_fp8_kernel"](
        (t,), block, x, res8, w, q, s, t, h, np.float32(1e-5), int(residual), int(vec_ok)
    )
    normed = torch.full((t, h), math.nan, dtype=dtype)
    emu[dt, "rms_norm_kernel"](
        (t,), block, x, res16, w, normed, t, h, np.float32(1e-5), int(residual), int(vec_ok)
    )
    want = ref8.quantize_fp8(normed)
    assert torch.equal(_codes(q), _codes(want)) and torch.equal(s, want.scale)
    assert torch.equal(res8, res16)
    # and the reference op itself, within the 16-bit rounding of the normed values
    res_ref = res.clone()
    if residual:
        want_ref, _ = ref8.add_rms_norm_fp8(x, res_ref, w, 1e-5)
        assert torch.equal(res8, res_ref)
    else:
        want_ref = ref8.rms_norm_fp8(x, w, 1e-5)
    deq = ref8.Fp8Rows(q, s).dequantize()
    err = (deq - want_ref.dequantize()).norm() / want_ref.dequantize().norm()
    assert err < 2e-2


@pytest.mark.parametrize("dt", list(CFG))
@pytest.mark.parametrize(
    "t,i,aligned", [(4, 1001, True), (3, 1536, True), (5, 64, False), (2, 40000, True)]
)
def test_silu_and_mul_fp8_is_the_recipe_on_silu_and_mul(emu, dt, t, i, aligned):
    g = torch.Generator().manual_seed(i + t)
    dtype = TORCH[dt]
    x = (3 * torch.randn(t, 2 * i, generator=g)).to(dtype)
    x[1] = 0
    if not aligned:
        x = _unaligned(x)
    vec = 16 // x.element_size()
    vec_ok = i % vec == 0 and x.data_ptr() % 16 == 0
    q, s = _fp8_out(t, i)
    emu[dt, "silu_and_mul_fp8_kernel"](
        (t,), row_block(i // vec if vec_ok else i, 4), x, q, s, t, i, int(vec_ok)
    )
    act = torch.full((t, i), math.nan, dtype=dtype)
    per = i // vec if vec_ok else i
    emu[dt, "silu_and_mul_kernel"]((math.ceil(per / 256), t), 256, x, act, t, i, int(vec_ok))
    want = ref8.quantize_fp8(act)
    assert torch.equal(_codes(q), _codes(want)) and torch.equal(s, want.scale)
    deq, full = ref8.Fp8Rows(q, s).dequantize(), ref8.silu_and_mul_fp8(x).dequantize()
    assert (deq - full).norm() / full.norm() < 2e-2


@pytest.mark.parametrize("dt", list(CFG))
@pytest.mark.parametrize(
    "scales,smooth", [((1.0, 1.0), False), ((0.05, 0.02), True), ((0.001, 0.002), False)]
)
def test_rope_kv_fp8_write_bit_exact(emu, dt, scales, smooth):
    """Codes sat((k - k_mean) * float32(1 / k_scale)) from the float32 rotation (the smallest
    scales saturate many values at +-448; k_mean zero or random per KV head and channel),
    slot -1 rows untouched, q as the reference's."""
    cfg = CFG[dt]
    hd, nq, nkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    t, bs, nblocks, max_pos = 13, 4, 7, 64
    g = torch.Generator().manual_seed(hd + int(scales[0] * 100))
    mag = 0.3 if scales[0] == 0.05 else 3.0
    qkv = (mag * torch.randn(t, (nq + 2 * nkv) * hd, generator=g)).to(TORCH[dt])
    pos = torch.randint(0, max_pos, (t,), generator=g)
    slots = torch.randperm(nblocks * bs, generator=g)[:t]
    slots[::4] = -1  # padding rows: the cache keeps its poison there
    cos, sin = rope_tables(hd, max_pos)
    kc = torch.full((nblocks, bs, nkv, hd), 0x7F, dtype=torch.uint8).view(E4M3)
    vc = kc.clone()
    kr, vr = kc.clone(), vc.clone()
    q = torch.full((t, nq, hd), math.nan, dtype=TORCH[dt])
    ks, vs = scales
    mean = mag * torch.randn(nkv, hd, generator=g) if smooth else torch.zeros(nkv, hd)
    emu[dt, "rope_kv_fp8_kernel"](
        (t,), 128, qkv, pos, cos, sin, kc, vc, slots, q, t, max_pos,
        np.float32(1.0 / ks), np.float32(1.0 / vs), mean,
    )  # fmt: skip
    q_ref = ref.rope_and_cache_write(qkv, pos, cos, sin, kr, vr, slots, ks, vs, mean)
    assert torch.equal(_codes(kc), _codes(kr))
    assert torch.equal(_codes(vc), _codes(vr))
    if smooth:  # the mean reached the codes: without it they differ
        unsmoothed = kc.clone()
        ref.rope_and_cache_write(qkv, pos, cos, sin, unsmoothed, vc.clone(), slots, ks, vs)
        assert not torch.equal(_codes(kc), _codes(unsmoothed))
    if scales[0] == 0.001:
        assert (kc.float().abs() == 448).sum() > 10 and (vc.float().abs() == 448).sum() > 10
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("dt", [*CFG, "g8"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits,min_keys,bs", [(1, 1, 16), (4, 16, 16), (3, 7, 24)])
def test_decode_attention(emu, dt, fp8, splits, min_keys, bs):
    """The split kernel (tensor-core pass for 16-bit dtypes with hd % 16 == 0, CUDA-core
    otherwise) on a 16-bit or an e4m3 cache with scales; partials merged by the last CTA,
    arrival counters back to zero."""
    cfg = CFG_G8 if dt == "g8" else CFG[dt]
    hd, nq, nkv, dtype = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads, TORCH[cfg.dtype]
    g = torch.Generator().manual_seed(splits * 10 + bs + fp8)
    meta, nblocks, t = paged_batch([1, 17, 70, 130], [], bs, generator=g)
    ks, vs = (0.05, 0.02) if fp8 else (1.0, 1.0)
    cache_dt = E4M3 if fp8 else dtype
    kc = (torch.randn(nblocks, bs, nkv, hd, generator=g) / ks).to(cache_dt)
    vc = (torch.randn(nblocks, bs, nkv, hd, generator=g) / vs).to(cache_dt)
    q = (2 * torch.randn(t, nq, hd, generator=g)).to(dtype)
    out = torch.full((t, nq * hd), math.nan, dtype=dtype)
    rows = t * nq * splits
    part_acc, part_ml = torch.empty(rows * hd), torch.empty(rows * 2)
    counters = torch.zeros(t * nkv, dtype=torch.int32)
    bs_shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
    tables = meta.block_tables
    name = "paged_attention_fp8_kernel" if fp8 else "paged_attention_kernel"
    emu[dt, name](
        (t, nkv, splits), 128, q, kc, vc, tables, tables.shape[1], bs, meta.seq_lens,
        meta.cu_seqlens_q, len(meta.seq_lens), 0, 1, out, part_acc, part_ml,
        np.float32(LOG2E / math.sqrt(hd) * ks), min_keys, bs_shift, counters, np.float32(vs),
    )  # fmt: skip
    want = ref.paged_attention(q, kc, vc, meta, ks, vs)
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_attention(emu, dt, fp8):
    """Prefill chunks on tensor cores (emulated mma.sync / ldmatrix); the bf16 kernel is
    the GPU-verified one (so this also checks the emulation), the fp8 one reads e4m3 tiles."""
    cfg = CFG[dt]
    hd, nq, nkv = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    g = torch.Generator().manual_seed(7 + fp8)
    meta, nblocks, t = paged_batch([], [(37, 37), (70, 150), (1, 50)], 16, generator=g)
    cache_dt = E4M3 if fp8 else TORCH[dt]
    ks, vs = (0.05, 0.02) if fp8 else (1.0, 1.0)
    kc = (torch.randn(nblocks, 16, nkv, hd, generator=g) / ks).to(cache_dt)
    vc = (torch.randn(nblocks, 16, nkv, hd, generator=g) / vs).to(cache_dt)
    q = (2 * torch.randn(t, nq, hd, generator=g)).to(TORCH[dt])
    out = torch.full((t, nq * hd), math.nan, dtype=TORCH[dt])
    tiles = math.ceil(meta.max_query_len * (nq // nkv) / 64)
    name = "prefill_attention_fp8_kernel" if fp8 else "prefill_attention_kernel"
    tables = meta.block_tables
    emu[dt, name](
        (tiles, len(meta.seq_lens), nkv), 128, q, kc, vc, tables, tables.shape[1], 16,
        meta.seq_lens, meta.cu_seqlens_q, 0, out, np.float32(LOG2E / math.sqrt(hd) * ks),
        np.float32(vs),
    )  # fmt: skip
    want = ref.paged_attention(q, kc, vc, meta, ks, vs)
    assert rel_err(out, want) < 1e-2
