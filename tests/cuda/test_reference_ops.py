"""Every torch reference op (llmc.cuda.reference) against an independent formulation.

References: transformers' LlamaRMSNorm / LlamaMLP / rotary embedding / apply_rotary_pos_emb,
torch's scaled_dot_product_attention on contiguous K/V, and the Random123 known-answer
vectors of Philox4x32-10.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama as hf_llama

from llmc.compiler.spec import ModelSpec
from llmc.cuda import reference as ref
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.backend import (
    BACKEND_OPS,
    FP8_OPS,
    OPS_WITHOUT_OUT,
    REFERENCE_NAMES,
    AttentionMetadata,
)
from llmc.cuda.torch_backend import TorchBackend
from llmc.runtime.rope import cos_sin_tables

SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.0), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_llama_rmsnorm(dtype, tol):
    g = _gen()
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    norm = hf_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
    norm = norm.to(dtype)
    with torch.no_grad():
        expect = norm(x)
    got = ref.rms_norm(x, norm.weight.detach(), 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expect.float(), atol=tol, rtol=tol)


def test_add_rms_norm_updates_residual_in_place():
    g = _gen(1)
    x, res, w = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.rand(32)
    total = x + res
    normed, res_out = ref.add_rms_norm(x, res, w, 1e-6)
    assert res_out is res and torch.equal(res, total)
    assert torch.equal(normed, ref.rms_norm(total, w, 1e-6))


def test_linear_and_silu_and_mul_match_llama_mlp():
    cfg = transformers.LlamaConfig(**SMALL)
    torch.manual_seed(0)
    mlp = hf_llama.LlamaMLP(cfg).eval()
    x = torch.randn(9, 64, generator=_gen(2))
    with torch.no_grad():
        expect = mlp(x)
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
        got = ref.linear(ref.silu_and_mul(ref.linear(x, gate_up)), mlp.down_proj.weight)
    torch.testing.assert_close(got, expect, atol=1e-6, rtol=1e-6)
    b = torch.randn(96, generator=_gen(3))
    lin = torch.nn.Linear(64, 96)
    with torch.no_grad():
        lin.bias.copy_(b)
        torch.testing.assert_close(ref.linear(x, lin.weight, b), lin(x))


def test_embedding():
    table = torch.randn(50, 8, generator=_gen(4))
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(ref.embedding(ids, table), torch.nn.functional.embedding(ids, table))


ROPE_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
]


def _rope_config(scaling, **kw) -> transformers.LlamaConfig:
    cfg = dict(SMALL, rope_theta=50000.0, **kw)
    if scaling:
        cfg["rope_scaling"] = scaling
    return transformers.LlamaConfig(**cfg)


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_tables_match_transformers(scaling, head_dim):
    cfg = _rope_config(scaling, head_dim=head_dim)
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    assert (spec.rope_scaling is None) == (scaling is None)
    cos, sin = cos_sin_tables(spec, 4096)
    rot = hf_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.arange(4096)[None]
    hf_cos, hf_sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    half = head_dim // 2
    assert torch.equal(cos, hf_cos[0, :, :half]) and torch.equal(sin, hf_sin[0, :, :half])
    assert torch.equal(hf_cos[0, :, half:], hf_cos[0, :, :half])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.0), (torch.bfloat16, 1e-2)])
def test_rope_and_cache_write_matches_apply_rotary_pos_emb(dtype, tol):
    cfg = _rope_config(ROPE_SCALINGS[2])
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    nq, nkv, hd, tpb, nblocks = 4, 2, 16, 4, 6
    t = 9
    cos, sin = cos_sin_tables(spec, 1024)
    g = _gen(5)
    qkv = torch.randn(t, (nq + 2 * nkv) * hd, generator=g).to(dtype)
    positions = torch.tensor([1000, 0, 3, 517, 2, 64, 65, 999, 7])
    slots = torch.tensor([0, 5, -1, 23, 1, 10, 11, -1, 17])
    k_cache = torch.full((nblocks, tpb, nkv, hd), 7.0, dtype=dtype)
    v_cache = k_cache.clone()
    q_rot = ref.rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, slots)
    # transformers: [batch, heads, seq, hd] with cos/sin from its own rotary module
    rot = hf_llama.LlamaRotaryEmbedding(cfg)
    hf_cos, hf_sin = rot(torch.zeros(1, dtype=torch.float32), positions[None])
    q = qkv[:, : nq * hd].float().view(1, t, nq, hd).transpose(1, 2)
    k = qkv[:, nq * hd : (nq + nkv) * hd].float().view(1, t, nkv, hd).transpose(1, 2)
    q_hf, k_hf = hf_llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)  # [t, heads, hd]
    assert q_rot.dtype == dtype and q_rot.shape == (t, nq, hd)
    torch.testing.assert_close(q_rot.float(), q_hf.to(dtype).float(), atol=tol, rtol=tol)
    v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd)
    kf, vf = k_cache.view(-1, nkv, hd), v_cache.view(-1, nkv, hd)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(
                kf[slot].float(), k_hf[i].to(dtype).float(), atol=tol, rtol=tol
            )
            assert torch.equal(vf[slot], v[i])
    untouched = torch.ones(nblocks * tpb, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (kf[untouched] == 7.0).all() and (vf[untouched] == 7.0).all()


def _paged_case(dtype: torch.dtype, seed: int):
    """Sequences (query len, context len), decode-first, in a paged cache of shuffled blocks."""
    rng = random.Random(seed)
    g = _gen(seed)
    nq, nkv, hd, tpb, nblocks = 8, 2, 16, 4, 64
    cases = [(1, 1), (1, 13), (1, 30), (7, 7), (5, 22), (16, 16), (3, 9)]
    free = list(range(nblocks))
    rng.shuffle(free)
    k_cache = torch.randn(nblocks, tpb, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, tpb, nkv, hd, generator=g).to(dtype)
    max_blocks = max(-(-ctx // tpb) for _, ctx in cases)
    tables = torch.full((len(cases), max_blocks), -1, dtype=torch.int32)
    contiguous = []
    for b, (_, ctx) in enumerate(cases):
        blocks = [free.pop() for _ in range(-(-ctx // tpb))]
        tables[b, : len(blocks)] = torch.tensor(blocks)
        contiguous.append(
            (ref.gather_kv(k_cache, tables[b], ctx), ref.gather_kv(v_cache, tables[b], ctx))
        )
    qlens = [n for n, _ in cases]
    cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, nq, hd, generator=g).to(dtype)
    positions = torch.cat([torch.arange(ctx - n, ctx) for n, ctx in cases])
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor([ctx for _, ctx in cases], dtype=torch.int32),
        block_tables=tables,
        num_decode_seqs=sum(1 for n, _ in cases if n == 1),
        max_query_len=max(qlens),
        max_seq_len=max(ctx for _, ctx in cases),
    )
    return q, k_cache, v_cache, meta, cases, contiguous


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_paged_attention_matches_sdpa(dtype, tol):
    q, k_cache, v_cache, meta, cases, contiguous = _paged_case(dtype, seed=6)
    out = ref.paged_attention(q, k_cache, v_cache, meta)
    nq, hd = q.shape[1], q.shape[2]
    assert out.shape == (q.shape[0], nq * hd) and out.dtype == dtype
    cu = meta.cu_seqlens_q.tolist()
    for b, (n, ctx) in enumerate(cases):
        k, v = contiguous[b]  # [ctx, nkv, hd]
        g = nq // k.shape[1]
        kk = k.float().repeat_interleave(g, dim=1).transpose(0, 1)[None]  # [1, nq, ctx, hd]
        vv = v.float().repeat_interleave(g, dim=1).transpose(0, 1)[None]
        qq = q[cu[b] : cu[b + 1]].float().transpose(0, 1)[None]  # [1, nq, n, hd]
        causal = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=ctx - n)
        expect = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=causal)
        expect = expect[0].transpose(0, 1).reshape(n, nq * hd)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].float(), expect, atol=tol, rtol=tol)


def test_torch_backend_writes_into_out_views():
    be = TorchBackend("cpu")
    q, k_cache, v_cache, meta, _, _ = _paged_case(torch.float32, seed=7)
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"))
    res = be.attention(q, k_cache, v_cache, meta, out=out)
    assert res is out and torch.equal(out, ref.paged_attention(q, k_cache, v_cache, meta))
    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    out = torch.full((5, 6), float("nan"))
    assert be.linear(x, w, b, out=out) is out
    torch.testing.assert_close(out, ref.linear(x, w, b))
    gu = torch.randn(5, 12)
    out = torch.full((5, 6), float("nan"))
    assert be.silu_and_mul(gu, out=out) is out and torch.equal(out, ref.silu_and_mul(gu))
    table, ids = torch.randn(10, 4), torch.tensor([1, 9, 1])
    out = torch.empty(3, 4)
    assert be.embedding(ids, table, out=out) is out and torch.equal(out, table[ids])


def _reference(op: str):
    return getattr(ref8 if op in FP8_OPS else ref, REFERENCE_NAMES.get(op, op))


def test_torch_backend_ops_are_the_reference_functions():
    import inspect

    assert {"rms_norm", "attention", "norm_linear", "sample"} <= set(BACKEND_OPS)
    for op in BACKEND_OPS:
        method = inspect.getattr_static(TorchBackend, op)
        assert getattr(method, "__wrapped__", getattr(method, "__func__", None)) is _reference(op)


@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_backend_ops_take_the_reference_parameters(backend):
    """The protocol's one rule for signatures: the reference function's parameters, same
    names and order, then ``out`` (not for OPS_WITHOUT_OUT)."""
    import inspect

    if backend == "cuda":
        from llmc.cuda.cuda_backend import CudaBackend as cls  # no GPU needed to import
    else:
        cls = TorchBackend
    for op in BACKEND_OPS:
        want = list(inspect.signature(_reference(op)).parameters)
        want += [] if op in OPS_WITHOUT_OUT else ["out"]
        got = list(inspect.signature(getattr(cls, op)).parameters)
        if not isinstance(inspect.getattr_static(cls, op), staticmethod):
            assert got[0] == "self", (op, got)
            got = got[1:]
        assert got == want, (backend, op)


def test_torch_backend_takes_out_positionally():
    be = TorchBackend("cpu")
    x, w = torch.randn(5, 8), torch.randn(8)
    out = torch.full((5, 8), float("nan"))
    assert be.rms_norm(x, w, 1e-5, out) is out
    assert torch.equal(out, ref.rms_norm(x, w, 1e-5))
    res = x.clone()
    normed, back = be.add_rms_norm(torch.ones(5, 8), res, w, 1e-5, out)
    assert normed is out and back is res and torch.equal(res, x + 1)
    with pytest.raises(TypeError):
        be.rms_norm(x, w, 1e-5, out, out)


# Random123 tests/kat_vectors, "philox4x32 10" lines: counter words, key words, output words.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,expect", PHILOX_KAT)
def test_philox_known_answers(ctr, key, expect):
    def t(x: int) -> torch.Tensor:
        return torch.tensor([x], dtype=torch.int64)

    out = ref.philox4x32_10(tuple(t(c) for c in ctr), (t(key[0]), t(key[1])))
    assert tuple(int(w) for w in out) == expect


def test_philox_uniform_recipe_and_batch_independence():
    seeds = torch.tensor([0, -1, 2**40 + 7, 123], dtype=torch.int64)
    offsets = torch.tensor([0, 5, 2**33 + 1, 0], dtype=torch.int64)
    u = ref.philox_uniform(seeds, offsets, 300)
    assert u.shape == (4, 300) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    k = u.double() * 2**24
    assert torch.equal(k, k.round()) and (k.long() % 2 == 1).all()  # (2 * (x >> 9) + 1) / 2**24
    # seed 0, offset 0, v 0: x = first KAT word 0x6627E8D5
    assert float(u[0, 0]) == (2 * (0x6627E8D5 >> 9) + 1) * 2**-24
    # seed -1 is the uint64 0xFFFF...FF: key words (ffffffff, ffffffff)
    for i in range(4):
        alone = ref.philox_uniform(seeds[i : i + 1], offsets[i : i + 1], 300)
        assert torch.equal(alone[0], u[i])
    assert not torch.equal(u[0], u[3]) and not torch.equal(u[0, 1:], u[0, :-1])
