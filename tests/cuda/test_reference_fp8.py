"""The FP8 reference ops (llmc.cuda.reference_fp8) against independent formulations:
e4m3's value grid, float32 matmuls of the dequantized operands, and the BF16 ops they
approximate (within the error of 3 mantissa bits)."""

from __future__ import annotations

import math

import pytest
import torch

from llmc.cuda import reference as ref
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.backend import AttentionMetadata
from llmc.cuda.reference_fp8 import FP8_MAX, Fp8Rows
from llmc.cuda.torch_backend import TorchBackend

E4M3_REL = 2.0**-4  # half an ulp of 3 mantissa bits, relative (normal range)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, from the bit patterns (independent of torch's cast)."""
    vals = []
    for bits in range(256):
        sign = -1.0 if bits & 0x80 else 1.0
        exp, man = (bits >> 3) & 0xF, bits & 0x7
        if exp == 0xF and man == 0x7:
            continue  # NaN
        v = man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        vals.append(sign * v)
    return torch.tensor(sorted(set(vals)), dtype=torch.float64)


def test_saturate_to_fp8_rounds_to_the_nearest_e4m3_value():
    grid = _e4m3_values()
    assert grid.max() == FP8_MAX
    x = torch.randn(4000, generator=_gen(0), dtype=torch.float64) * 50
    x = torch.cat([x, torch.tensor([1e6, -1e6, 0.0, 2.0**-10])])
    got = ref8.saturate_to_fp8(x.float()).double()
    xc = x.clamp(-FP8_MAX, FP8_MAX)
    nearest = grid[(grid[None, :] - xc[:, None]).abs().argmin(dim=1)]
    dist_got = (got - xc).abs()
    dist_best = (nearest - xc).abs()
    assert torch.all(dist_got <= dist_best + 1e-12)  # ties may go either way: even


def test_saturate_to_fp8_sends_every_tie_to_the_even_code():
    """Every midpoint between adjacent e4m3 values (subnormals included) goes to the value
    whose mantissa's last bit is 0 (CUDA's round-to-nearest-even), never up or down alone."""
    grid = _e4m3_values()
    grid = grid[grid >= 0]
    lo, hi = grid[:-1], grid[1:]
    mid = (lo + hi) / 2
    got = ref8.saturate_to_fp8(mid.float()).double()
    codes = torch.stack([lo, hi]).float().to(torch.float8_e4m3fn).view(torch.uint8)
    even = torch.where(codes[0] % 2 == 0, lo, hi)
    assert torch.equal(got, even)
    assert torch.equal(ref8.saturate_to_fp8(-mid.float()).double(), -even)


def test_quantize_fp8_per_row_recipe():
    x = torch.randn(6, 64, generator=_gen(1)) * torch.tensor([1, 1e-3, 10, 300, 1e4, 0])[:, None]
    rows = ref8.quantize_fp8(x)
    assert rows.q.dtype == torch.float8_e4m3fn and rows.scale.dtype == torch.float32
    amax = x.abs().amax(-1).clamp(min=ref8.MIN_AMAX)
    torch.testing.assert_close(rows.scale, amax / FP8_MAX, rtol=0, atol=0)
    # the largest element of each non-zero row maps to ±448
    assert torch.all(rows.q.float().abs().amax(-1)[:5] == FP8_MAX)
    deq = rows.dequantize()
    assert torch.all(deq[5] == 0) and torch.isfinite(rows.scale[5])
    big = x.abs() >= amax[:, None] * 2.0**-6  # normal range of e4m3 relative to amax
    rel = ((deq - x).abs() / x.abs().clamp(min=1e-30))[big]
    assert rel.max() <= E4M3_REL + 1e-6


def test_quantize_weight_fp8_is_per_output_channel():
    w = torch.randn(8, 32, generator=_gen(2)) * torch.logspace(-2, 2, 8)[:, None]
    q, s = ref8.quantize_weight_fp8(w)
    assert q.shape == (8, 32) and s.shape == (8,)
    torch.testing.assert_close(q.float() * s[:, None], w, rtol=E4M3_REL, atol=s.max() * 2**-9)


def test_linear_fp8_is_the_matmul_of_the_dequantized_operands():
    x = torch.randn(5, 64, generator=_gen(3)).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=_gen(4)) * 0.05
    b = torch.randn(48, generator=_gen(5))
    wq, ws = ref8.quantize_weight_fp8(w)
    xr = ref8.quantize_fp8(x)
    got = ref8.linear_fp8(xr, wq, ws, b, torch.float32)
    exact = xr.dequantize().double() @ (wq.double() * ws.double()[:, None]).t() + b.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    assert ref8.linear_fp8(xr, wq, ws, None, torch.bfloat16).dtype == torch.bfloat16
    # and it approximates the BF16 layer within the quantization error (~2 * 2^-4 / sqrt(K))
    full = x.float() @ w.t() + b
    err = (got - full).norm() / full.norm()
    assert err < 0.05


def test_fused_fp8_ops_are_their_compositions():
    g = _gen(6)
    res = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(32, generator=g)).to(torch.bfloat16)
    w, gu = torch.randn(24, 32, generator=g), torch.randn(40, 32, generator=g)
    wq, ws = ref8.quantize_weight_fp8(w)
    gq, gs = ref8.quantize_weight_fp8(gu)
    got = ref8.norm_linear_fp8(res, nw, 1e-5, wq, ws)
    want = ref8.linear_fp8(ref8.quantize_fp8(ref.rms_norm(res, nw, 1e-5)), wq, ws, None, res.dtype)
    assert torch.equal(got, want)
    act = ref8.norm_gate_up_silu_fp8(res, nw, 1e-5, gq, gs)
    assert act.shape == (3, 20) and act.dtype == torch.bfloat16
    down = torch.randn(32, 20, generator=g)
    dq, ds = ref8.quantize_weight_fp8(down)
    r1, r2 = res.clone(), res.clone()
    out = ref8.linear_residual_add_fp8(act, dq, ds, r1)
    assert out is r1
    assert torch.equal(r1, r2 + ref8.linear_fp8(ref8.quantize_fp8(act), dq, ds, None, r2.dtype))
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    r3 = res.clone()
    rows, r3_out = ref8.add_rms_norm_fp8(x, r3, nw, 1e-5)
    assert r3_out is r3 and torch.equal(r3, res + x)
    assert torch.equal(
        rows.q.view(torch.uint8), ref8.rms_norm_fp8(r3, nw, 1e-5).q.view(torch.uint8)
    )
    silu = ref8.silu_and_mul_fp8(torch.randn(3, 40, generator=g))
    assert silu.q.shape == (3, 20)


def test_torch_backend_writes_fp8_rows_into_out():
    be = TorchBackend("cpu")
    x, w = torch.randn(4, 16), torch.rand(16)
    out = Fp8Rows(torch.empty(4, 16, dtype=torch.float8_e4m3fn), torch.full((4,), math.nan))
    got = be.rms_norm_fp8(x, w, 1e-6, out=out)
    assert got is out
    want = ref8.rms_norm_fp8(x, w, 1e-6)
    assert torch.equal(out.scale, want.scale)
    assert torch.equal(out.q.view(torch.uint8), want.q.view(torch.uint8))
    with pytest.raises(TypeError, match="Fp8Rows"):
        be.rms_norm_fp8(x, w, 1e-6, out=torch.empty(4, 16))


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_fp8_kv_cache_write_and_attention(scales):
    k_scale, v_scale = scales
    g = _gen(7)
    nq, nkv, hd, tpb, nblocks = 4, 2, 16, 4, 6
    t = 9
    mag = 0.5 / max(k_scale, v_scale) * 0.02 if k_scale < 1 else 1.0
    qkv = (torch.randn(t, (nq + 2 * nkv) * hd, generator=g) * mag).to(torch.bfloat16)
    pos = torch.arange(t)
    cos = torch.cos(torch.outer(torch.arange(64.0), torch.rand(hd // 2, generator=g)))
    sin = torch.sin(torch.outer(torch.arange(64.0), torch.rand(hd // 2, generator=g)))
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 12])  # blocks 1, 2, 3 of a 9-token seq
    caches = {}
    for dt in (torch.bfloat16, torch.float8_e4m3fn):
        kc = torch.zeros(nblocks, tpb, nkv, hd, dtype=dt)
        vc = torch.zeros(nblocks, tpb, nkv, hd, dtype=dt)
        s = scales if dt == torch.float8_e4m3fn else (1.0, 1.0)
        q = ref.rope_and_cache_write(qkv, pos, cos, sin, kc, vc, slots, *s)
        caches[dt] = (q, kc, vc)
    _, kb, vb = caches[torch.bfloat16]
    q, k8, v8 = caches[torch.float8_e4m3fn]
    used = kb.view(-1, nkv, hd)[slots].float()
    deq = k8.view(-1, nkv, hd)[slots].float() * k_scale
    assert ((deq - used).abs() <= used.abs() * E4M3_REL + k_scale * 2**-9 + 2e-2 * used.abs()).all()
    meta = AttentionMetadata(
        positions=pos,
        slot_mapping=slots,
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
        num_decode_seqs=0,
        max_query_len=t,
        max_seq_len=t,
    )
    want = ref.paged_attention(q, kb, vb, meta).float()
    got = ref.paged_attention(q, k8, v8, meta, k_scale, v_scale).float()
    assert (got - want).norm() / want.norm() < 0.08
    # the scales are applied: reading the fp8 cache as if unscaled is far off
    if k_scale != 1.0:
        off = ref.paged_attention(q, k8, v8, meta).float()
        assert (off - want).norm() / want.norm() > 0.3


def test_smooth_k_leaves_attention_and_cuts_its_fp8_error():
    """Keys with a large per-channel mean (as post-RoPE k of SmolLM2): caching k - mean
    (k_mean) leaves attention what it was (the cache holds k - m exactly in float32:
    softmax cancels q.m) and, in e4m3, is closer to the exact attention than caching k."""
    g = _gen(11)
    nq, nkv, hd, tpb, nblocks, t = 4, 2, 32, 8, 4, 24
    qkv = torch.randn(t, (nq + 2 * nkv) * hd, generator=g)
    k = qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
    k.mul_(0.3).add_(4.0 * torch.randn(nkv, hd, generator=g))  # a big constant per channel
    pos = torch.arange(t)
    cos, sin = torch.ones(64, hd // 2), torch.zeros(64, hd // 2)  # identity rotation
    slots = torch.arange(tpb, tpb + t)
    mean = k.mean(0)
    meta = AttentionMetadata(
        positions=pos,
        slot_mapping=slots,
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
        num_decode_seqs=0,
        max_query_len=t,
        max_seq_len=t,
    )

    def attend(dtype: torch.dtype, k_mean: torch.Tensor | None, k_scale: float) -> torch.Tensor:
        kc = torch.zeros(nblocks, tpb, nkv, hd, dtype=dtype)
        vc = torch.zeros_like(kc)
        q = ref.rope_and_cache_write(qkv, pos, cos, sin, kc, vc, slots, k_scale, 1.0, k_mean)
        if dtype == torch.float32 and k_mean is not None:  # a float cache ignores k_mean:
            kc.view(-1, nkv, hd)[slots] -= k_mean  # subtract it by hand to check invariance
        return ref.paged_attention(q, kc, vc, meta, k_scale, 1.0).float()

    exact = attend(torch.float32, None, 1.0)
    shifted = attend(torch.float32, mean, 1.0)
    torch.testing.assert_close(shifted, exact, rtol=1e-4, atol=1e-5)
    e4m3 = torch.float8_e4m3fn
    plain = attend(e4m3, None, float(k.abs().max()) / FP8_MAX)
    smooth = attend(e4m3, mean, float((k - mean).abs().max()) / FP8_MAX)
    err_plain = (plain - exact).norm() / exact.norm()
    err_smooth = (smooth - exact).norm() / exact.norm()
    assert err_smooth < 0.5 * err_plain, (err_smooth, err_plain)
    # and the float32 cache is written as before: k_mean is ignored there
    kc = torch.zeros(nblocks, tpb, nkv, hd)
    ref.rope_and_cache_write(qkv, pos, cos, sin, kc, torch.zeros_like(kc), slots, 1, 1, mean)
    assert torch.equal(kc.view(-1, nkv, hd)[slots], k)
