"""Mixed fp8 engines on the GPU (``--exclude_modules``: some projections kept in bf16): the
CUDA backend against the torch reference backend on the same engine weights (dummy, SmolLM2
shape, bf16 activations, fp8 KV), eager and with CUDA graphs, batched and at batch 1 (whose
decode steps take the fused small-step GEMVs: gemv_fp8 for the fp8 projections, gemv for
the bf16 ones).

- every projection excluded: bit for bit the bf16 engine on the same backend (the same
  kernels run), logits and greedy tokens;
- a mix (the last layer's MLP, layer 0's qkv, layer 7's o_proj in bf16): the CUDA logits of
  one prefill step no farther from the float32 execution of the same engine than the torch
  backend's (the bound of tests/cuda/test_cuda_fp8_e2e.py), greedy first tokens agreeing
  with the torch backend's for at least half the requests.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.engines import SMOLLM2, make_limits
from llmc.compiler.dummy import dummy_weights
from llmc.compiler.quantization import FP8_PROJECTIONS
from llmc.compiler.weight_passes import quantize_engine_weights
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.cuda

MIX = ("layers.0.qkv_proj", "layers.7.o_proj", "layers.29.gate_up_proj", "layers.29.down_proj")
ALL = tuple(f"layers.{i}.{p}" for i in range(SMOLLM2.num_layers) for p in FP8_PROJECTIONS)
NEW = (24, 9, 30, 16, 5, 27)


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def bf16_weights():
    return dummy_weights(SMOLLM2, "bfloat16", seed=0, device="cuda")


def runtime(weights, backend: str, quant: str, floats=(), graphs=False, dtype="bfloat16"):
    limits = make_limits(
        max_batch_size=8, max_input_len=64, max_seq_len=128, max_num_tokens=128,
        tokens_per_block=8, dtype=dtype, quantization=quant, kv_cache_dtype="fp8",
        float_projections=tuple(floats),
    )  # fmt: skip
    w = quantize_engine_weights(SMOLLM2, weights.items(), quant, "fp8", "dummy", None, floats)
    if dtype == "float32":
        w = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in w.items()}
    config = RuntimeConfig(device="cuda", backend=backend, cuda_graphs=graphs)
    return EngineRuntime.from_weights(
        SMOLLM2, w, limits=limits, num_kv_blocks=64, device="cuda", backend=backend,
        config=config,
    )  # fmt: skip


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    lens = (3, 11, 25, 40, 1, 17)[:n]
    return [[rng.randrange(3, SMOLLM2.vocab_size) for _ in range(k)] for k in lens]


def greedy(rt: EngineRuntime, n: int = 6) -> list[list[int]]:
    sp = [SamplingParams(max_new_tokens=k, ignore_eos=True) for k in NEW[:n]]
    outs = rt.executor().generate(_prompts(n), sp)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    rt.kv.check_invariants()
    return [o.token_ids for o in outs]


def _prefill_logits(rt: EngineRuntime) -> torch.Tensor:
    from helpers.runner import BlockAllocator, new_seq
    from llmc.runtime.types import ScheduledBatch, ScheduledSequence

    runner = rt.runner
    alloc = BlockAllocator(runner.kv_cache.num_blocks, runner.limits.tokens_per_block)
    seqs = [new_seq(i, p, 1) for i, p in enumerate(_prompts())]
    for s in seqs:
        alloc.ensure(s, s.num_prompt_tokens)
    batch = ScheduledBatch(
        0, tuple(ScheduledSequence(s, 0, s.num_prompt_tokens, True) for s in seqs)
    )
    return runner.forward_logits(batch).float()


def _dist(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().amax(dim=-1) / b.std(dim=-1)).max().item()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("n", [6, 1], ids=["batch6", "batch1"])
def test_every_projection_excluded_is_the_bf16_engine_on_cuda(bf16_weights, graphs, n):
    mixed = runtime(bf16_weights, "cuda", "fp8", ALL, graphs)
    plain = runtime(bf16_weights, "cuda", "none", (), graphs)
    assert torch.equal(_prefill_logits(mixed), _prefill_logits(plain))
    assert greedy(mixed, n) == greedy(plain, n)


def test_mixed_prefill_logits_cuda_as_close_as_torch(bf16_weights):
    exact = _prefill_logits(runtime(bf16_weights, "torch", "fp8", MIX, dtype="float32"))
    ref = _prefill_logits(runtime(bf16_weights, "torch", "fp8", MIX))
    ours = _prefill_logits(runtime(bf16_weights, "cuda", "fp8", MIX))
    assert torch.isfinite(ours).all()
    d_ref, d_ours = _dist(ref, exact), _dist(ours, exact)
    print(f"\nmixed fp8: max|Δ|/std to float32: torch {d_ref:.4f} cuda {d_ours:.4f}")
    assert d_ours <= 1.5 * d_ref + 0.02, (d_ours, d_ref)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("n", [6, 1], ids=["batch6", "batch1"])
def test_mixed_greedy_cuda_agrees_with_torch(bf16_weights, graphs, n):
    ref = greedy(runtime(bf16_weights, "torch", "fp8", MIX), n)
    rt = runtime(bf16_weights, "cuda", "fp8", MIX, graphs)
    ours = greedy(rt, n)
    assert (rt.runner.graphs is not None) == graphs
    first = sum(o[0] == r[0] for o, r in zip(ours, ref, strict=True)) / len(ref)
    equal = sum(x == y for o, r in zip(ours, ref, strict=True) for x, y in zip(o, r, strict=True))
    total = sum(map(len, ref))
    print(f"\nmixed fp8 n={n} graphs={graphs}: first token {first:.0%}, "
          f"position-wise {equal / total:.1%}")  # fmt: skip
    assert first >= 0.5, f"first-token agreement {first:.0%}"
