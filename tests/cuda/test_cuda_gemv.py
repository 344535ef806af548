"""The fused small-step GEMV kernels (cuda/gemv.cu) against their torch references, on the GPU.

norm_linear, norm_gate_up_silu and linear_residual_add for float32 / float16 / bfloat16,
M = 1..8 token rows, the Llama-3-8B shapes and odd ones (K not a multiple of the 16-byte
vector: the *_scalar kernels; N not a multiple of the rows per unit; K long enough that the
staged activations are chunked), outputs poisoned with NaN; relative error below 1e-5
(float32) or 1e-2 (16-bit) as in test_cuda_kernels. Also: misaligned bases, CUDA-graph
capture and replay, and the errors (M = 9, shape mismatches). Run with
``pytest -m cuda -o addopts=""`` on a GPU.

The FP8 ops (cuda/gemv_fp8.cu: norm_linear_fp8, norm_gate_up_silu_fp8,
linear_residual_add_fp8) the same way against llmc.cuda.reference_fp8, on weights quantized
per output row (quantize_weight_fp8), at the 8B and SmolLM2-135M shapes and K tails; also the
unfused fallback past the shared-memory budget.
"""

from __future__ import annotations

import pytest
import torch

from llmc.base.errors import ConfigError, UnsupportedError
from llmc.cuda import reference as ref
from llmc.cuda import reference_fp8 as ref8

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-5

# (op, K, N): N = output rows (norm / add) or I (silu: the weight has 2I rows)
CASES = [
    ("norm", 4096, 6144),  # 8B qkv (with and without bias below)
    ("add", 4096, 4096),  # 8B o_proj
    ("silu", 4096, 14336),  # 8B gate_up
    ("add", 14336, 4096),  # 8B down (chunked staging at M >= 4)
    ("norm", 1004, 77),  # K % 8 != 0: scalar kernels for 16-bit (vector for fp32), odd N
    ("silu", 999, 33),  # K odd: scalar kernels for every dtype
    ("add", 12001, 37),  # scalar kernels, chunked at M >= 5
    ("norm", 12000, 300),  # vector kernels, chunked at M >= 5
    ("silu", 576, 1536),  # SmolLM2-135M
    ("add", 64, 5),  # tiny: N below one unit per CTA
]


@pytest.fixture(scope="module")
def be():
    from llmc.cuda.cuda_backend import CudaBackend

    return CudaBackend(DEV)


_WEIGHTS: dict[tuple, torch.Tensor] = {}


def weight(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Random [rows, K] weights (cached: the 8B ones are up to 470 MB), dots of unit scale."""
    key = (rows, k, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        g = torch.Generator(device=DEV).manual_seed(rows * 7 + k)
        w = torch.randn(rows, k, device=DEV, generator=g) / k**0.5
        _WEIGHTS[key] = w.to(dtype)
    return _WEIGHTS[key]


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    o, w = out.double(), want.double()
    return ((o - w).norm() / w.norm().clamp_min(1e-30)).item()


def poisoned(*shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def inputs(m: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    residual = (3 * torch.randn(m, k, device=DEV, generator=g)).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(k, device=DEV, generator=g)).to(dtype)
    return residual, norm_w


def check_op(be, op: str, m: int, k: int, n: int, dtype: torch.dtype, bias: bool = False):
    residual, norm_w = inputs(m, k, dtype, seed=m * 1000 + k)
    tol = TOL[dtype]
    if op == "norm":
        w = weight(n, k, dtype)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        out = be.norm_linear(residual, norm_w, EPS, w, b, out=poisoned(m, n, dtype=dtype))
        assert rel_err(out, ref.norm_linear(residual, norm_w, EPS, w, b)) < tol
    elif op == "silu":
        w = weight(2 * n, k, dtype)
        out = be.norm_gate_up_silu(residual, norm_w, EPS, w, out=poisoned(m, n, dtype=dtype))
        assert rel_err(out, ref.norm_gate_up_silu(residual, norm_w, EPS, w)) < tol
    else:
        w = weight(n, k, dtype)
        x = residual
        res = torch.randn(m, n, device=DEV).to(dtype)
        before = res.clone()
        want = ref.linear_residual_add(x, w, res.clone())
        got = be.linear_residual_add(x, w, res)
        assert got.data_ptr() == res.data_ptr()
        assert rel_err(res, want) < tol
        assert rel_err(res.double() - before.double(), want.double() - before.double()) < 2 * tol


@pytest.mark.parametrize("m", range(1, 9))  # fastest-varying: the cached weights are reused
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_vs_reference(be, dtype, case, m):
    op, k, n = CASES[case]
    check_op(be, op, m, k, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_norm_linear_bias(be, dtype, m):
    check_op(be, "norm", m, 4096, 6144, dtype, bias=True)
    check_op(be, "norm", m, 1004, 77, dtype, bias=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_bases_take_the_scalar_kernels(be, dtype):
    """Views whose base is not 16-byte aligned (K a multiple of 8) still give right results."""
    m, k, n = 3, 512, 96
    residual, norm_w = inputs(m, k, dtype, seed=3)
    res_u = torch.empty(m * k + 1, device=DEV, dtype=dtype)[1:].view(m, k).copy_(residual)
    w = weight(n, k, dtype)
    w_u = torch.empty(n * k + 1, device=DEV, dtype=dtype)[1:].view(n, k).copy_(w)
    out = be.norm_linear(res_u, norm_w, EPS, w_u, out=poisoned(m, n, dtype=dtype))
    assert rel_err(out, ref.norm_linear(residual, norm_w, EPS, w)) < TOL[dtype]
    res = torch.randn(m, n, device=DEV).to(dtype)
    want = ref.linear_residual_add(residual, w, res.clone())
    be.linear_residual_add(res_u, w_u, res)
    assert rel_err(res, want) < TOL[dtype]


def check_graph_replay(body, reference, res, residual, scratch, tol: float) -> None:
    """body() (a layer's ops on the static residual ``res``) warmed up eagerly (module load,
    shared-memory attribute), captured in a CUDA graph, replayed on fresh residuals with the
    ``scratch`` buffers poisoned: each result matches ``reference(fresh residual)``."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    res.copy_(residual)
    with torch.cuda.graph(g):
        body()
    m, k = residual.shape
    for seed in (1, 2):
        fresh, _ = inputs(m, k, residual.dtype, seed=seed)
        res.copy_(fresh)
        for t in scratch:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(res, reference(fresh.clone())) < tol


def test_cuda_graph_capture_and_replay(be):
    """The three ops captured in one graph, replayed on new inputs in the static buffers."""
    dtype, m, k, n, i = torch.bfloat16, 4, 1024, 768, 1408
    residual, norm_w = inputs(m, k, dtype, seed=11)
    wq, wo = weight(n, k, dtype).clone(), weight(k, n, dtype).clone()
    wgu, wd = weight(2 * i, k, dtype).clone(), weight(k, i, dtype).clone()
    qkv = torch.empty(m, n, device=DEV, dtype=dtype)
    act = torch.empty(m, i, device=DEV, dtype=dtype)
    res = residual.clone()

    def body():
        be.norm_linear(res, norm_w, EPS, wq, out=qkv)
        be.linear_residual_add(qkv, wo, res)
        be.norm_gate_up_silu(res, norm_w, EPS, wgu, out=act)
        be.linear_residual_add(act, wd, res)

    def reference(r):
        q = ref.norm_linear(r, norm_w, EPS, wq)
        ref.linear_residual_add(q, wo, r)
        a = ref.norm_gate_up_silu(r, norm_w, EPS, wgu)
        return ref.linear_residual_add(a, wd, r)

    check_graph_replay(body, reference, res, residual, (qkv, act), TOL[dtype])


def test_errors(be):
    dtype, k, n = torch.bfloat16, 256, 64
    residual, norm_w = inputs(9, k, dtype, seed=0)
    w = weight(n, k, dtype)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.norm_linear(residual, norm_w, EPS, w)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.norm_gate_up_silu(residual, norm_w, EPS, weight(2 * n, k, dtype))
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.linear_residual_add(residual, w, torch.zeros(9, n, device=DEV, dtype=dtype))
    r8 = residual[:8]
    with pytest.raises(UnsupportedError, match="do not chain"):
        be.norm_linear(r8, norm_w, EPS, weight(n, k + 8, dtype))
    with pytest.raises(UnsupportedError, match="norm weight"):
        be.norm_linear(r8, norm_w[:-8], EPS, w)
    with pytest.raises(UnsupportedError, match="out has shape"):
        be.norm_linear(r8, norm_w, EPS, w, out=torch.empty(8, n + 1, device=DEV, dtype=dtype))
    with pytest.raises(UnsupportedError, match="bias"):
        be.norm_linear(r8, norm_w, EPS, w, torch.zeros(n + 1, device=DEV, dtype=dtype))
    with pytest.raises(UnsupportedError, match="even"):
        be.norm_gate_up_silu(r8, norm_w, EPS, weight(2 * n + 1, k, dtype))
    with pytest.raises(UnsupportedError, match="residual"):
        be.linear_residual_add(r8, w, torch.zeros(8, n + 1, device=DEV, dtype=dtype))
    with pytest.raises(UnsupportedError, match="weight must be"):
        be.norm_linear(r8, norm_w, EPS, w.float())
    from llmc.cuda.cuda_backend import CudaBackend

    with pytest.raises(ConfigError, match="fused_decode_max_tokens"):
        CudaBackend(DEV, fused_decode_max_tokens=9)
    assert CudaBackend(DEV, fused_decode_max_tokens=0).fused_decode_max_tokens == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_runner_fused_decode_matches_unfused(arch, request):
    """The ModelRunner on the CudaBackend (float32): every step's logits with fused small
    steps (fused_decode_max_tokens = 8) match the unfused ops (0), greedy ids equal."""
    from helpers.engines import load_engine_weights
    from helpers.runner import drive, make_runner, new_seq, prompts
    from llmc.cuda.cuda_backend import CudaBackend

    spec, weights = load_engine_weights(request.getfixturevalue(f"tiny_{arch}_dir"))
    results = []
    for fused in (0, 8):
        be = CudaBackend(DEV, fused_decode_max_tokens=fused)
        runner = make_runner(spec, weights, backend=be, device=DEV, max_num_tokens=64)
        ps = prompts(6, [3, 11, 25, 1, 17, 6], spec.vocab_size, seed=4)
        seqs = [new_seq(i, p, 4 + 2 * i) for i, p in enumerate(ps)]
        results.append(drive(runner, seqs, chunk=16, budget=40, start_every=2, record_logits=True))
    unfused, fused_res = results
    assert unfused.outputs == fused_res.outputs
    assert unfused.logits.keys() == fused_res.logits.keys()
    for key, row in unfused.logits.items():
        torch.testing.assert_close(fused_res.logits[key], row, atol=1e-4, rtol=1e-4)


# ---- FP8 (W8A8) small-step ops: cuda/gemv_fp8.cu -------------------------------------------

# (op, K, N) as CASES: the 8B and SmolLM2-135M shapes (hidden 576, 9 + 3 + 3 heads of 64,
# intermediate 1536), K tails
CASES8 = [
    ("norm", 4096, 6144),  # 8B qkv
    ("add", 4096, 4096),  # 8B o_proj
    ("silu", 4096, 14336),  # 8B gate_up
    ("add", 14336, 4096),  # 8B down
    ("norm", 576, 960),  # SmolLM2 qkv
    ("add", 576, 576),  # SmolLM2 o_proj
    ("silu", 576, 1536),  # SmolLM2 gate_up
    ("add", 1536, 576),  # SmolLM2 down
    ("norm", 1000, 77),  # K % 16 != 0: scalar kernels
    ("silu", 999, 33),
    ("add", 1008, 37),  # K % 64 != 0: a partial last k-step in the vector kernels
    ("add", 64, 5),  # tiny: one tile, one k-step
]
# Kernel and reference quantize the same values the same way; float32 allows the rare
# activation code one e4m3 step off where rsqrt / the sum of squares differ in the last bit.
TOL8 = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
_WEIGHTS8: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def weight8(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [rows, K], float32 scale [rows]) of random weights, per output row (cached)."""
    key = (rows, k)
    if key not in _WEIGHTS8:
        _WEIGHTS8.clear()
        _WEIGHTS8[key] = ref8.quantize_weight_fp8(weight(rows, k, torch.float32))
    return _WEIGHTS8[key]


def copy8(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight8 copied out of the one-entry cache (for tests that hold several)."""
    w, ws = weight8(rows, k)
    return w.clone(), ws.clone()


def check_op8(be, op: str, m: int, k: int, n: int, dtype: torch.dtype, bias: bool = False):
    residual, norm_w = inputs(m, k, dtype, seed=m * 1000 + k + 7)
    tol = TOL8[dtype]
    assert be._gemv8_fused(m, k)  # the kernel, not the unfused fallback
    if op == "norm":
        w, ws = weight8(n, k)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        out = be.norm_linear_fp8(residual, norm_w, EPS, w, ws, b, out=poisoned(m, n, dtype=dtype))
        assert rel_err(out, ref8.norm_linear_fp8(residual, norm_w, EPS, w, ws, b)) < tol
    elif op == "silu":
        w, ws = weight8(2 * n, k)
        out = be.norm_gate_up_silu_fp8(
            residual, norm_w, EPS, w, ws, out=poisoned(m, n, dtype=dtype)
        )
        # the reference rounds gate and up to the dtype before silu·mul, the kernel rounds
        # once: in bfloat16 (8-bit mantissa) that alone reaches ~1 % (1.05 % seen on the H200)
        tol = 1.5e-2 if dtype == torch.bfloat16 else tol
        assert rel_err(out, ref8.norm_gate_up_silu_fp8(residual, norm_w, EPS, w, ws)) < tol
    else:
        w, ws = weight8(n, k)
        x = residual
        res = torch.randn(m, n, device=DEV).to(dtype)
        before = res.clone()
        want = ref8.linear_residual_add_fp8(x, w, ws, res.clone())
        got = be.linear_residual_add_fp8(x, w, ws, res)
        assert got.data_ptr() == res.data_ptr()
        assert rel_err(res, want) < tol
        assert rel_err(res.double() - before.double(), want.double() - before.double()) < 2 * tol


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("case", range(len(CASES8)), ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_fp8_vs_reference(be, dtype, case, m):
    op, k, n = CASES8[case]
    check_op8(be, op, m, k, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_norm_linear_fp8_bias(be, dtype, m):
    check_op8(be, "norm", m, 4096, 6144, dtype, bias=True)
    check_op8(be, "norm", m, 1000, 77, dtype, bias=True)


def test_fp8_misaligned_bases_take_the_scalar_kernels(be):
    """Activation views whose base is not 16-byte aligned (K a multiple of 16)."""
    dtype, m, k, n = torch.bfloat16, 3, 512, 96
    residual, norm_w = inputs(m, k, dtype, seed=3)
    res_u = torch.empty(m * k + 1, device=DEV, dtype=dtype)[1:].view(m, k).copy_(residual)
    w, ws = weight8(n, k)
    out = be.norm_linear_fp8(res_u, norm_w, EPS, w, ws, out=poisoned(m, n, dtype=dtype))
    assert rel_err(out, ref8.norm_linear_fp8(residual, norm_w, EPS, w, ws)) < TOL8[dtype]
    res = torch.randn(m, n, device=DEV).to(dtype)
    want = ref8.linear_residual_add_fp8(residual, w, ws, res.clone())
    be.linear_residual_add_fp8(res_u, w, ws, res)
    assert rel_err(res, want) < TOL8[dtype]


def test_fp8_unfused_past_the_staging_budget(be):
    """8 rows of K = 24576 codes do not fit the shared-memory budget: the unfused ops run
    (same values); 7 rows still take the kernel."""
    dtype, k, n = torch.bfloat16, 24576, 64
    assert not be._gemv8_fused(8, k) and be._gemv8_fused(7, k)
    w, ws = weight8(2 * n, k)
    for m in (8, 7):
        residual, norm_w = inputs(m, k, dtype, seed=m)
        out = be.norm_gate_up_silu_fp8(
            residual, norm_w, EPS, w, ws, out=poisoned(m, n, dtype=dtype)
        )
        assert rel_err(out, ref8.norm_gate_up_silu_fp8(residual, norm_w, EPS, w, ws)) < TOL8[dtype]
        out = be.norm_linear_fp8(residual, norm_w, EPS, w, ws, out=poisoned(m, 2 * n, dtype=dtype))
        assert rel_err(out, ref8.norm_linear_fp8(residual, norm_w, EPS, w, ws)) < TOL8[dtype]
        res = torch.randn(m, 2 * n, device=DEV).to(dtype)
        want = ref8.linear_residual_add_fp8(residual, w, ws, res.clone())
        be.linear_residual_add_fp8(residual, w, ws, res)
        assert rel_err(res, want) < TOL8[dtype]


def test_fp8_cuda_graph_capture_and_replay(be):
    """The three FP8 ops captured in one graph, replayed on new inputs in the static buffers."""
    dtype, m, k, n, i = torch.bfloat16, 4, 1024, 768, 1408
    residual, norm_w = inputs(m, k, dtype, seed=11)
    (wq, sq), (wo, so) = copy8(n, k), copy8(k, n)
    (wgu, sgu), (wd, sd) = copy8(2 * i, k), copy8(k, i)
    qkv = torch.empty(m, n, device=DEV, dtype=dtype)
    act = torch.empty(m, i, device=DEV, dtype=dtype)
    res = residual.clone()

    def body():
        be.norm_linear_fp8(res, norm_w, EPS, wq, sq, out=qkv)
        be.linear_residual_add_fp8(qkv, wo, so, res)
        be.norm_gate_up_silu_fp8(res, norm_w, EPS, wgu, sgu, out=act)
        be.linear_residual_add_fp8(act, wd, sd, res)

    def reference(r):
        q = ref8.norm_linear_fp8(r, norm_w, EPS, wq, sq)
        ref8.linear_residual_add_fp8(q, wo, so, r)
        a = ref8.norm_gate_up_silu_fp8(r, norm_w, EPS, wgu, sgu)
        return ref8.linear_residual_add_fp8(a, wd, sd, r)

    check_graph_replay(body, reference, res, residual, (qkv, act), TOL8[dtype])


def test_fp8_errors(be):
    dtype, k, n = torch.bfloat16, 256, 64
    residual, norm_w = inputs(9, k, dtype, seed=0)
    w, ws = weight8(n, k)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.norm_linear_fp8(residual, norm_w, EPS, w, ws)
    with pytest.raises(UnsupportedError, match="9 token rows"):
        be.linear_residual_add_fp8(residual, w, ws, torch.zeros(9, n, device=DEV, dtype=dtype))
    r8 = residual[:8]
    with pytest.raises(UnsupportedError, match="float8_e4m3fn"):
        be.norm_linear_fp8(r8, norm_w, EPS, weight(n, k, dtype), ws)
    with pytest.raises(UnsupportedError, match="weight scale has shape"):
        be.norm_linear_fp8(r8, norm_w, EPS, w, ws[:-1].contiguous())
    with pytest.raises(UnsupportedError, match="do not chain"):
        be.linear_residual_add_fp8(
            r8[:, :-16].contiguous(), w, ws, torch.zeros(8, n, device=DEV, dtype=dtype)
        )
