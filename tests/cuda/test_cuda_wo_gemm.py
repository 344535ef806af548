"""The weight-only linear of larger steps on tensor cores (llmc.cuda.gemm_wo_ops:
cuda/gemm_wo.cu, mma.sync; cuda/gemm_wo_sm90.cu, wgmma, sm_90 only) against
llmc.cuda.reference on fresh random PackedWeights, on the GPU.

Each plan (``CudaBackend.wo_gemm`` = ``mma`` / ``sm90``; the GEMV passes turned off so every
T > 8 reaches it, and the plan asserted to be the one that runs) over every layout the
engines write (4 / 8 bits, group sizes 16 .. K, offsets or none, f16 / f32 scales, the
GGUF-like code_zeros), odd M, N not a multiple of the tiles, K of 2.5 k-tiles and the
Llama-3-8B shapes, bias, float32 logits, bf16 and f16 activations; outputs poisoned with
NaN; relative error below 1e-2 against the reference (the float32-accumulated GEMM of the
exact weights, rounded once), and within one output rounding of x @ w16.T (w16: the
dequantize-then-cuBLAS plan's 16-bit weights; row-scaled layouts, scaled in the epilogue:
of the reference). Also CUDA-graph capture, and int4_wo / int8_wo engines whose prefill
steps run on the plan, greedy tokens against dequantize-then-cuBLAS. Run with
``pytest -m cuda -o addopts=""`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import rel_err
from helpers.checkpoints import TINY_LLAMA
from helpers.packed_weights import WO_LAYOUTS, layout_packed
from llmc.cuda import reference as ref
from llmc.cuda.gemm_wo_ops import gw_row_scaled

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect these anyway
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")

DEV = torch.device("cuda")
F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
PLANS = ["mma", "sm90"]


@pytest.fixture(scope="module")
def be():
    from llmc.cuda.cuda_backend import CudaBackend

    b = CudaBackend(DEV)
    b.wo_gemv_passes = (1, 1)  # T > 8 rows: the large-step plan
    return b


def _plan(be, plan: str):
    if plan == "sm90" and torch.cuda.get_device_capability(DEV) != (9, 0):
        pytest.skip("gemm_wo_sm90.cu runs on sm_90 only")
    be.wo_gemm = plan


def packed(name: str, rows: int, k: int, seed: int = 0):
    return layout_packed(name, rows, k, seed, DEV)


def check_linear(be, plan, w, m, dtype=BF16, bias=True, logits=False) -> None:
    n, k = w.shape
    g = torch.Generator(device=DEV).manual_seed(m * 1000 + k + n)
    x = (3 * torch.randn(m, k, device=DEV, generator=g)).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype) if bias else None
    assert be._wo_gemm_plan(x, w) == plan
    out = torch.full((m, n), float("nan"), device=DEV, dtype=F32 if logits else dtype)
    got = be.linear(x, w, b, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "an output was never written"
    want = ref.linear(x, w, b).float()
    assert rel_err(out.float(), want) < 1e-2
    w16 = w.dequantize().to(dtype).float()  # dequantize-then-cuBLAS's weight values
    same = (x.float() @ w16.T + (0 if b is None else b.float())).to(dtype).float()
    # one output rounding from x @ w16.T, or (row-scaled layouts on gemm_wo.cu: the integers
    # times the row's scale) from the reference; gemm_wo_sm90.cu never scales in its epilogue
    # (gemm_wo_ops.gw_launch), so it multiplies 16-bit weights like dequantize-then-cuBLAS
    close = want if plan != "sm90" and gw_row_scaled(w) else same
    torch.testing.assert_close(out.float(), close, rtol=2**-7, atol=2e-3)


# (K, N): "tail" K = 160 (2.5 k-tiles of 64) where the group divides it, else 1408 (22
# k-tiles); 1152 (18); N below / between the tiles, odd
SHAPES = [("tail", 33), (1152, 97), (1152, 300)]


@pytest.mark.parametrize("m", [9, 33, 130, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout", list(WO_LAYOUTS))
@pytest.mark.parametrize("plan", PLANS)
def test_layouts_vs_reference(be, plan, layout, shape, m):
    _plan(be, plan)
    k, n = shape
    if k == "tail":
        k = 160 if 160 % (WO_LAYOUTS[layout][1] or 160) == 0 else 1408
    check_linear(be, plan, packed(layout, n, k, seed=k + n), m)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", ["int4_g128_asym", "int8_perchannel", "q4_k", "q6_k"])
@pytest.mark.parametrize("plan", PLANS)
def test_dtypes_bias_and_logits(be, plan, layout, dtype):
    _plan(be, plan)
    w = packed(layout, 200, 1024, seed=3)
    for m, bias, logits in ((17, False, False), (129, True, True), (257, True, False)):
        check_linear(be, plan, w, m, dtype, bias=bias, logits=logits)


# the Llama-3-8B projections: qkv, o_proj, gate_up, down (N, K)
SHAPES_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}  # fmt: skip


@pytest.mark.parametrize("m", [64, 512, 1024])
@pytest.mark.parametrize("proj", list(SHAPES_8B))
@pytest.mark.parametrize("layout", ["int4_g128_asym", "int8_perchannel"])
@pytest.mark.parametrize("plan", PLANS)
def test_8b_shapes(be, plan, layout, proj, m):
    _plan(be, plan)
    n, k = SHAPES_8B[proj]
    check_linear(be, plan, packed(layout, n, k, seed=n), m, bias=False)


@pytest.mark.parametrize("plan", PLANS)
def test_graph_capture_and_replay(be, plan):
    """The large-step linear captured in a CUDA graph, replayed on fresh inputs."""
    _plan(be, plan)
    m, k, n = 200, 1024, 640
    w = packed("int4_g128_asym", n, k, 5)
    x = torch.zeros(m, k, device=DEV, dtype=BF16)
    out = torch.empty(m, n, device=DEV, dtype=BF16)
    be.linear(x, w, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.linear(x, w, out=out)
    for seed in (1, 2):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(m, k, device=DEV, generator=g))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref.linear(x, w, None)) < 1e-2


# a small Llama shape whose projections the kernels take (K = 512 / 1024, group 64)
SMALL_HF = {
    "architectures": ["LlamaForCausalLM"], **TINY_LLAMA, "vocab_size": 8192,
    "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
    "num_attention_heads": 8, "head_dim": 64,
}  # fmt: skip


def build_small_wo(out, quantization: str, target: str = "auto", dtype: str = "bfloat16"):
    """A dummy-weight engine of SMALL_HF quantized ``quantization`` (group 64)."""
    from helpers.engines import tiny_build_config
    from llmc.compiler.builder import build

    cfg = tiny_build_config(
        None, output_dir=str(out), dtype=dtype, target=target, load_format="dummy",
        quantization=quantization, group_size=64, max_seq_len=256, max_num_tokens=256,
        max_batch_size=8, tokens_per_block=16,
    )  # fmt: skip
    build(cfg, model_config=SMALL_HF)
    return out


@pytest.mark.parametrize("quantization", ["int4_wo", "int8_wo"])
@pytest.mark.parametrize("plan", PLANS)
def test_engine_prefill_on_the_plan(plan, quantization, tmp_path, monkeypatch):
    """A weight-only engine through the runtime: its prefill steps (up to 143 rows at once)
    on ``plan`` give the greedy tokens of dequantize-then-cuBLAS (the same rounded weights,
    another accumulation order: random weights part only after a near-tie)."""
    from llmc.cuda.gemm_wo_ops import WoGemmOps
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
    from llmc.runtime.types import SamplingParams

    if plan == "sm90" and torch.cuda.get_device_capability(DEV) != (9, 0):
        pytest.skip("gemm_wo_sm90.cu runs on sm_90 only")
    out = build_small_wo(tmp_path / quantization, quantization)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 8192, (n,), generator=g).tolist() for n in (9, 21, 48, 65)]
    tokens = {}
    for p in ("dequant", plan):
        monkeypatch.setattr(WoGemmOps, "wo_gemm", p)
        rt = EngineRuntime.load(out, RuntimeConfig(device="cuda", backend="cuda"))
        outs = rt.executor().generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
        assert all(o.ok for o in outs)
        tokens[p] = [o.token_ids for o in outs]
    ref, ours = tokens["dequant"], tokens[plan]
    first = sum(a[0] == b[0] for a, b in zip(ours, ref, strict=True)) / len(ref)
    same = sum(x == y for a, b in zip(ours, ref, strict=True) for x, y in zip(a, b, strict=True))
    share = same / sum(map(len, ref))
    print(f"{quantization} {plan}: greedy agreement with dequantize-then-cuBLAS {share:.1%}")
    assert first >= 0.75 and share >= 0.5, (first, share)
