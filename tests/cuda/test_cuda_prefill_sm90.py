"""The Hopper prefill attention (cuda/prefill_attention_sm90.cu) against the reference.

Fresh random inputs, outputs poisoned with NaN, relative error below 1e-2 against
``llmc.cuda.reference.paged_attention``: head_dim 128 / 64, GQA and nkv == nq, ragged
varlen batches, chunks over cached context, partial last blocks and row tiles, block sizes
16 .. 128, decode rows before the prefill rows (left untouched by the launcher), bf16 and
f16 activations, bf16 and fp8 (e4m3, one scale per tensor) caches, repeated launches
bit-identical, and the CudaBackend's selection (on by default on sm_90, off by attribute).
Run with ``pytest -m cuda -o addopts=""`` on an H100 / H200.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import paged_batch, rel_err
from llmc.base.errors import UnsupportedError
from llmc.cuda import reference as ref

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")
if torch.cuda.get_device_capability() != (9, 0):  # pragma: no cover
    pytest.skip("prefill_attention_sm90.cu is sm_90a only", allow_module_level=True)

DEV = torch.device("cuda")
TOL = 1e-2
# (head_dim, num_q_heads, num_kv_heads): Llama-8B, SmolLM2-135M, MHA at both head dims
HEADS = ((128, 32, 8), (64, 9, 3), (128, 8, 8), (64, 4, 4))
CASES = [
    # (decode context lengths, prefill (q_len, seq_len) chunks, tokens_per_block)
    ([], [(1000, 1000)], 32),  # one sequence: partial last row tile, key tile and block
    ([], [(37, 37), (100, 260), (1, 50), (300, 300), (129, 129)], 16),  # ragged, chunks
    ([], [(512, 3000), (77, 4000)], 32),  # chunks after long cached contexts
    ([5, 64, 129], [(70, 70), (33, 200)], 64),  # decode rows first (seq_begin > 0)
    ([], [(256, 256), (2048, 2048)], 128),
]


@pytest.fixture(scope="module")
def be():
    from llmc.cuda.cuda_backend import CudaBackend

    return CudaBackend(DEV)


def inputs(case, hd, nq, nkv, dtype):
    decode, prefill, bs = case
    meta, nblocks, t = paged_batch(decode, prefill, bs, DEV)
    kc = torch.randn(nblocks, bs, nkv, hd, device=DEV).to(dtype)
    vc = torch.randn(nblocks, bs, nkv, hd, device=DEV).to(dtype)
    q = (2 * torch.randn(t, nq, hd, device=DEV)).to(dtype)
    return meta, q, kc, vc


def quantize(cache: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Per-tensor e4m3 (scale = amax / 448): (fp8 cache, scale, its float32 dequantization)."""
    scale = cache.float().abs().max().item() / 448.0
    q8 = (cache.float() / scale).to(torch.float8_e4m3fn)
    return q8, scale, q8.float() * scale


def check_prefill(be, q, kc, vc, meta, want_kc, want_vc, **scales):
    nd = meta.num_decode_seqs
    rows = int(meta.cu_seqlens_q[nd])  # decode rows come first
    t, nq, hd = q.shape
    out = torch.full((t, nq * hd), float("nan"), dtype=q.dtype, device=DEV)
    be._sm90.launch(q, kc, vc, meta, out, **scales)
    want = ref.paged_attention(q, want_kc, want_vc, meta)
    assert torch.isnan(out[:rows]).all(), "the launcher must leave decode rows alone"
    assert rel_err(out[rows:], want[rows:]) < TOL
    return out


@pytest.mark.parametrize("hd,nq,nkv", HEADS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_sm90_bf16_cache(be, hd, nq, nkv, case):
    meta, q, kc, vc = inputs(CASES[case], hd, nq, nkv, torch.bfloat16)
    check_prefill(be, q, kc, vc, meta, kc, vc)


@pytest.mark.parametrize("hd,nq,nkv", HEADS[:2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prefill_sm90_fp8_cache(be, hd, nq, nkv, case):
    """The reference runs on the dequantized cache (float32); the kernel reads e4m3."""
    meta, q, kc, vc = inputs(CASES[case], hd, nq, nkv, torch.bfloat16)
    k8, ks, kf = quantize(3 * kc)  # amax far from 448: a scale != 1 matters
    v8, vs, vf = quantize(0.5 * vc)
    check_prefill(be, q, k8, v8, meta, kf, vf, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("cache", ["f16", "fp8"])
def test_prefill_sm90_float16(be, cache):
    meta, q, kc, vc = inputs(CASES[1], 128, 32, 8, torch.float16)
    if cache == "f16":
        check_prefill(be, q, kc, vc, meta, kc, vc)
    else:
        k8, ks, kf = quantize(kc)
        v8, vs, vf = quantize(vc)
        check_prefill(be, q, k8, v8, meta, kf, vf, k_scale=ks, v_scale=vs)


def test_prefill_sm90_long_causal(be):
    """The benchmark's shape: 4096 tokens causal, 32 / 8 heads x 128, one sequence."""
    meta, q, kc, vc = inputs(([], [(4096, 4096)], 32), 128, 32, 8, torch.bfloat16)
    check_prefill(be, q, kc, vc, meta, kc, vc)


def test_prefill_sm90_repeatable(be):
    """Three launches give bit-identical outputs (no race between the warpgroups)."""
    meta, q, kc, vc = inputs(CASES[2], 128, 32, 8, torch.bfloat16)
    outs = [check_prefill(be, q, kc, vc, meta, kc, vc) for _ in range(3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("hd,nq,nkv", HEADS[:2])
def test_backend_selects_sm90_and_can_turn_it_off(hd, nq, nkv):
    from llmc.cuda.cuda_backend import CudaBackend

    be = CudaBackend(DEV)
    assert be.sm90_prefill, "on by default on sm_90 (LLMC_SM90_PREFILL=0 turns it off)"
    meta, q, kc, vc = inputs(CASES[3], hd, nq, nkv, torch.bfloat16)
    want = ref.paged_attention(q, kc, vc, meta)
    for on, family in ((True, "prefill_sm90"), (False, "prefill_attention")):
        be.sm90_prefill = on
        assert be.prefill_kernel(q.dtype, hd, kc.shape[1]) == family
        out = torch.full((q.shape[0], nq * hd), float("nan"), dtype=q.dtype, device=DEV)
        be.attention(q, kc, vc, meta, out=out)
        assert rel_err(out, want) < TOL
    be.sm90_prefill = True
    assert be.prefill_kernel(q.dtype, 96, 32) == "prefill_attention"  # other head dims
    assert be.prefill_kernel(q.dtype, 128, 24) == "prefill_attention"  # non-power-of-two


def test_launcher_refuses_what_it_cannot_run(be):
    meta, q, kc, vc = inputs(CASES[0], 128, 32, 8, torch.bfloat16)
    out = torch.empty(q.shape[0], 32 * 128, dtype=q.dtype, device=DEV)
    with pytest.raises(UnsupportedError, match="k_scale"):
        be._sm90.launch(q, kc, vc, meta, out, k_scale=0.0)
    with pytest.raises(UnsupportedError, match="float8_e4m3fn"):
        be._sm90.launch(q, kc.float(), vc.float(), meta, out)
    with pytest.raises(UnsupportedError, match="tokens_per_block 24"):
        kc24 = torch.randn(4, 24, 8, 128, device=DEV).to(torch.bfloat16)
        be._sm90.launch(q, kc24, kc24, meta, out)
