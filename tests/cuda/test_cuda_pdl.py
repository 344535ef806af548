"""Programmatic dependent launch (cuda/pdl.cuh, llmc.cuda.pdl_launch) on the GPU: the fused
small-step GEMVs launched with PDL give the bits they give without it.

Each case runs one decoder layer's GEMV chain (qkv norm_linear -> o_proj add -> gate_up
norm_silu -> down add, each reading what the one before wrote, plus an attention-sized
gap filled by a copy) for bf16, fp8 (W8A8) and int4 weight-only weights at the 8B shapes,
M = 1 and 5 token rows, three times over in a CUDA graph (the engine's decode steps are
graph replays) and once eagerly; outputs poisoned with NaN before each run. A wait placed
after a read of the previous kernel's output shows up here as a different residual.
Run with ``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.packed_weights import random_packed
from llmc.cuda import reference_fp8 as ref8

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

DEV = torch.device("cuda")
H, INTER, QKV = 4096, 14336, 6144
EPS = 1e-5


@pytest.fixture(scope="module")
def be():
    from llmc.cuda.cuda_backend import CudaBackend

    b = CudaBackend(DEV)
    b.pdl_wo_max_tokens = 8  # the weight-only GEMVs with PDL at M = 5 too (default: M = 1)
    if not b.pdl:
        pytest.skip("PDL is off on this device (below sm_90 or LLMC_PDL=0)")
    return b


_CACHE: dict[str, dict] = {}


def _weights(kind: str) -> dict:
    if kind in _CACHE:
        return _CACHE[kind]
    _CACHE.clear()  # one kind at a time on the GPU (the bf16 8B layer is 436 MB)
    _CACHE[kind] = _make_weights(kind)
    return _CACHE[kind]


def _make_weights(kind: str) -> dict:
    g = torch.Generator(device=DEV).manual_seed(7)

    def dense(rows: int, k: int) -> torch.Tensor:
        return (torch.randn(rows, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)

    shapes = {"qkv": (QKV, H), "o": (H, H), "gu": (2 * INTER, H), "down": (H, INTER)}
    if kind == "bf16":
        return {n: dense(*s) for n, s in shapes.items()}
    if kind == "fp8":
        return {n: ref8.quantize_weight_fp8(dense(*s).float()) for n, s in shapes.items()}
    return {
        n: random_packed(r, k, 4, 128, offsets=True, seed=i, device=DEV)
        for i, (n, (r, k)) in enumerate(shapes.items())
    }


def _layer(be, kind: str, w: dict, x: torch.Tensor, nw: torch.Tensor, bufs: dict) -> None:
    """One layer's four GEMVs on the residual ``x`` (in place); ``bufs`` the outputs."""
    qkv, act = bufs["qkv"], bufs["act"]
    if kind == "fp8":
        be.norm_linear_fp8(x, nw, EPS, *w["qkv"], None, out=qkv)
    else:
        be.norm_linear(x, nw, EPS, w["qkv"], None, out=qkv)
    attn = qkv[:, :H].clone()  # an attention-sized gap between qkv and o_proj
    if kind == "fp8":
        be.linear_residual_add_fp8(attn, *w["o"], x)
        be.norm_gate_up_silu_fp8(x, nw, EPS, *w["gu"], act)
        be.linear_residual_add_fp8(act, *w["down"], x)
    else:
        be.linear_residual_add(attn, w["o"], x)
        be.norm_gate_up_silu(x, nw, EPS, w["gu"], out=act)
        be.linear_residual_add(act, w["down"], x)


def _run(be, kind: str, w: dict, x0: torch.Tensor, nw: torch.Tensor, pdl: bool, graph: bool):
    be.pdl = pdl
    m = x0.shape[0]
    x = x0.clone()
    bufs = {
        "qkv": torch.full((m, QKV), float("nan"), dtype=x0.dtype, device=DEV),
        "act": torch.full((m, INTER), float("nan"), dtype=x0.dtype, device=DEV),
    }
    if not graph:
        for _ in range(3):
            _layer(be, kind, w, x, nw, bufs)
        torch.cuda.synchronize()
        return x, bufs["qkv"]
    _layer(be, kind, w, x.clone(), nw, bufs)  # warm-up: kernels loaded before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(3):
            _layer(be, kind, w, x, nw, bufs)
    x.copy_(x0)
    bufs["qkv"].fill_(float("nan"))
    bufs["act"].fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return x, bufs["qkv"]


@pytest.mark.parametrize(
    "kind, m", [(k, m) for k in ("bf16", "fp8", "int4") for m in (1, 5)]
)  # one kind's weights at a time
def test_pdl_chain_equals_plain_launches(be, kind, m):
    w = _weights(kind)
    g = torch.Generator(device=DEV).manual_seed(m)
    x0 = torch.randn(m, H, device=DEV, generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).to(torch.bfloat16)
    try:
        want, want_qkv = _run(be, kind, w, x0, nw, pdl=False, graph=False)
        assert torch.isfinite(want.float()).all()
        for graph in (False, True):
            got, got_qkv = _run(be, kind, w, x0, nw, pdl=True, graph=graph)
            assert torch.equal(got, want), (kind, m, graph)
            assert torch.equal(got_qkv, want_qkv), (kind, m, graph)
    finally:
        be.pdl = True
