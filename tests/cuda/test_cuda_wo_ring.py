"""gemv_wo.cu's *_ring kernels (cuda/wo_ring.cuh: the codes streamed through a shared-memory
ring of cp.async stages) on the GPU, against llmc.cuda.reference and, bit for bit, against
the register-stream kernels (``WoOps.wo_stages = 0``) they replace.

Stage counts 2, 3, 4, 8 and 16 (the budget may allow fewer: the host's count is in the
launch), M = 1..8, every scale mode (row, kstep, deq) with f16 / f32 scales, offsets or
none, group sizes 16 / 32 / 64 / 128 / 256 / K, odd N, partial k-steps, several rounds of
tiles, the Llama-3-8B shapes; scales not 4-byte aligned (the register kernels serve them).
Outputs poisoned with NaN. The register kernels' one nondeterministic sum (row mode with
offsets: the per-row sum of x, float atomics over several warps) is compared within the
tolerance only. Run with ``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import rel_err
from helpers.packed_weights import WO_LAYOUTS, random_packed
from llmc.cuda import reference as ref
from llmc.cuda.gemv_wo_ops import wo_has_sums, wo_scale_mode

# collected everywhere (``-m cuda --co`` lists them), skipped without a GPU
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV, EPS = torch.device("cuda"), 1e-5
F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# every scale mode and group size: engine layouts (helpers.packed_weights.WO_LAYOUTS) and
# three more: name -> (bits, group_size (0 = K), offsets, scale dtype, code_zero)
LAYOUTS = {n: WO_LAYOUTS[n] for n in (
    "int4_g128_asym", "int8_perchannel", "int8_g64_asym", "q8_0", "q4_1", "q4_k", "q6_k",
    "int4_g16_asym",
)} | {
    "int4_g256_sym": (4, 256, False, F16, 8),  # kstep, two k-steps a group
    "int4_gK_asym": (4, 0, True, F16, 0),  # row + sums
    "int8_g128_f16": (8, 128, True, F16, 0),  # kstep, two k-steps a group, f16
}  # fmt: skip


@pytest.fixture(scope="module")
def be():
    pytest.importorskip("cupy")
    from llmc.cuda.cuda_backend import CudaBackend

    return CudaBackend(DEV)


def _weight(layout: str, rows: int, k: int, seed: int):
    bits, gs, offs, sdt, cz = LAYOUTS[layout]
    return random_packed(
        rows, k, bits, gs or k, offsets=offs, scale_dtype=sdt, code_zero=cz, seed=seed,
        device=DEV,
    )  # fmt: skip


def _inputs(m: int, k: int, n: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (3 * torch.randn(m, k, device=DEV, generator=g)).to(BF16)
    norm_w = (1 + 0.3 * torch.randn(k, device=DEV, generator=g)).to(BF16)
    bias = torch.randn(n, device=DEV, generator=g).to(BF16)
    res = torch.randn(m, n, device=DEV, generator=g).to(BF16)
    return x, norm_w, bias, res


def _run(be, op: str, w, x, norm_w, bias, res) -> torch.Tensor:
    """The op's output (add: the updated residual) in a fresh NaN-poisoned tensor."""
    m, n = res.shape
    if op == "norm":
        return be.norm_linear(x, norm_w, EPS, w, bias, out=torch.full_like(res, float("nan")))
    if op == "silu":
        return be.norm_gate_up_silu(x, norm_w, EPS, w, out=torch.full_like(res, float("nan")))
    if op == "add":
        return be.linear_residual_add(x, w, res.clone())
    out = torch.full((m, n), float("nan"), device=DEV, dtype=F32)  # float32 logits
    return be.linear(x, w, bias, out=out)


def _want(op: str, w, x, norm_w, bias, res) -> torch.Tensor:
    if op == "norm":
        return ref.norm_linear(x, norm_w, EPS, w, bias)
    if op == "silu":
        return ref.norm_gate_up_silu(x, norm_w, EPS, w)
    if op == "add":
        return ref.linear_residual_add(x, w, res.clone())
    return ref.linear(x, w, bias).float()


def _compare(be, monkeypatch, op, layout, w, m, n, stages, seed) -> None:
    k = w.shape[1]
    x, norm_w, bias, res = _inputs(m, k, n, seed)
    monkeypatch.setattr(be, "wo_stages", 0)
    reg = _run(be, op, w, x, norm_w, bias, res)
    monkeypatch.setattr(be, "wo_stages", stages)
    out = _run(be, op, w, x, norm_w, bias, res)
    assert not torch.isnan(out).any(), "NaN: an output was never written"
    want = _want(op, w, x, norm_w, bias, res)
    tol = 2.5e-2 if op == "silu" else 1e-2  # see test_cuda_wo.py's check_op
    if op == "add":  # the added part carries the error
        assert rel_err(out.double() - res.double(), want.double() - res.double()) < 2 * tol
    else:
        assert rel_err(out, want) < tol
    bits, gs, offs, _, _ = LAYOUTS[layout]
    smode = wo_scale_mode(bits, k, gs or k)
    if not (wo_has_sums(bits, smode, offs) and smode == "row" and k // 8 > 32):
        assert torch.equal(out, reg), f"{layout} {op}: ring and register kernels differ"


# (op, K, N): K = 5 x 256 (int4: 10 k-steps, int8: 20), odd N; gate_up N = I
SHAPES = [("norm", 1280, 77), ("silu", 1280, 45), ("add", 1280, 33), ("linear", 1280, 97)]


@pytest.mark.parametrize("m", [1, 3, 5, 8])
@pytest.mark.parametrize("stages", [2, 3, 8, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_vs_register_kernel(be, monkeypatch, layout, shape, stages, m):
    op, k, n = shape
    w = _weight(layout, 2 * n if op == "silu" else n, k, seed=k + n)
    _compare(be, monkeypatch, op, layout, w, m, n, stages, seed=m * 31 + stages)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("layout", ["int4_g128_asym", "int8_perchannel", "q4_k"])
def test_ring_every_token_count(be, monkeypatch, layout, m):
    for op, k, n in SHAPES:
        w = _weight(layout, 2 * n if op == "silu" else n, k, seed=k + n + m)
        _compare(be, monkeypatch, op, layout, w, m, n, 4, seed=m)


# partial k-steps (the ring's zero-filled copies), f16 scale rows of odd length (the
# 16-bit value in the high half of its word), several rounds of tiles (ring refills)
EDGES = [
    ("q4_1", "norm", 96, 21),  # one partial k-step (96 of 128 columns)
    ("q6_k", "add", 1008, 21),  # the last k-step partial (48 of 64 columns)
    ("q4_1", "silu", 224, 19),  # G = 7, f16
    ("q8_0", "linear", 224, 37),  # G = 7, f16
    ("int4_g128_asym", "linear", 256, 40000),  # 2500 tiles: 2 rounds on 132 SMs
    ("int8_perchannel", "silu", 512, 20000),  # 2500 tiles of 8 + 8 rows: 2 rounds
]


@pytest.mark.parametrize("stages", [2, 8])
@pytest.mark.parametrize("case", EDGES, ids=lambda c: f"{c[0]}-{c[1]}-k{c[2]}-n{c[3]}")
def test_ring_tails_and_rounds(be, monkeypatch, case, stages):
    layout, op, k, n = case
    w = _weight(layout, 2 * n if op == "silu" else n, k, seed=k)
    for m in (1, 8):
        _compare(be, monkeypatch, op, layout, w, m, n, stages, seed=m + k)


# the Llama-3-8B shapes: qkv, o_proj, gate_up (I), down
SHAPES_8B = [("norm", 4096, 6144), ("add", 4096, 4096), ("silu", 4096, 14336), ("add", 14336, 4096)]


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("shape", SHAPES_8B, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}")
@pytest.mark.parametrize("layout", ["int4_g128_asym", "int8_perchannel", "q4_k"])
def test_ring_8b_shapes(be, monkeypatch, layout, shape, m):
    op, k, n = shape
    w = _weight(layout, 2 * n if op == "silu" else n, k, seed=n)
    _compare(be, monkeypatch, op, layout, w, m, n, 8, seed=m)


def test_misaligned_scales_take_the_register_kernel(be, monkeypatch):
    """f16 scales whose base is 2 mod 4: no ring (it copies 32-bit words); same results."""
    k, n = 1280, 40
    w = _weight("q4_1", n, k, seed=5)
    odd = torch.empty(w.scales.numel() + 1, device=DEV, dtype=F16)[1:].view_as(w.scales)
    odd.copy_(w.scales)
    w2 = type(w)(w.codes, odd, w.offsets, w.bits, w.code_zero, w.group_size)
    x, norm_w, bias, res = _inputs(3, k, n, 1)
    out = _run(be, "norm", w2, x, norm_w, bias, res)
    monkeypatch.setattr(be, "wo_stages", 0)
    assert torch.equal(out, _run(be, "norm", w, x, norm_w, bias, res))
