"""On the GPU: one-sequence prefill steps replayed as CUDA graphs (llmc.runtime.prefill_graphs)
give the eager steps' tokens and logits, for every bucket (prompt lengths between and on
bucket sizes, a last chunk after earlier chunks), with the CUDA backend's prefill kernels
(float32 tiny models; bf16 SmolLM2 shape: the tensor-core / sm90 kernels), and really replay."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.engines import SMOLLM2, load_engine_weights
from helpers.runner import gpu_runtime, new_seq
from llmc.compiler.dummy import dummy_weights
from llmc.runtime.types import SamplingParams, ScheduledBatch, ScheduledSequence

pytestmark = pytest.mark.cuda

LENGTHS = (9, 16, 17, 40, 64)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    return load_engine_weights(request.getfixturevalue(f"tiny_{request.param}_dir"))


def _one_by_one(rt, sampling: SamplingParams) -> list[list[int]]:
    """Each prompt alone through the Executor, so its prefill step holds one sequence."""
    rng = random.Random(3)
    out = []
    for n in LENGTHS:
        prompt = [rng.randrange(3, rt.spec.vocab_size) for _ in range(n)]
        (o,) = rt.executor().generate([prompt], [sampling])
        assert o.ok, o.error
        out.append(o.token_ids)
    rt.kv.check_invariants()
    return out


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=6, ignore_eos=True),
        SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11),
    ],
    ids=["greedy", "seeded"],
)
def test_prefill_graphs_give_the_eager_tokens(model, sampling) -> None:
    graphed = gpu_runtime(model, prefill_graph_max_tokens=64)
    pre = graphed.runner.prefill_graphs
    assert pre is not None and pre.buckets == (16, 32, 64)
    assert graphed.summary()["prefill_graph_buckets"] == [16, 32, 64]
    got = _one_by_one(graphed, sampling)
    assert pre.replays == len(LENGTHS)
    eager = gpu_runtime(model, prefill_graph_max_tokens=0)
    assert eager.runner.prefill_graphs is None
    assert got == _one_by_one(eager, sampling)


def test_a_long_prompt_replays_only_its_last_chunk(model) -> None:
    rt = gpu_runtime(model, prefill_graph_max_tokens=32, max_num_tokens=24)
    pre = rt.runner.prefill_graphs
    assert pre is not None and pre.buckets == (16, 24)
    rng = random.Random(5)
    prompt = [rng.randrange(3, rt.spec.vocab_size) for _ in range(58)]  # 24 + 24 + 10
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    (a,) = rt.executor().generate([prompt], [sp])
    assert pre.replays == 1
    (b,) = (
        gpu_runtime(model, prefill_graph_max_tokens=0, max_num_tokens=24)
        .executor()
        .generate([prompt], [sp])
    )
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("n", [12, 33, 100])
def test_bf16_prefill_graph_logits_equal_eager(n) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    w = dummy_weights(SMOLLM2, "bfloat16", seed=1, device="cuda")
    rt = gpu_runtime((SMOLLM2, w), prefill_graph_max_tokens=128, dtype="bfloat16")
    runner = rt.runner
    assert runner.weights["embed_tokens"].dtype == torch.bfloat16
    prompt = random.Random(n).sample(range(3, SMOLLM2.vocab_size), n)
    s = new_seq(0, prompt, 1)
    s.block_table, s.block_table_version = list(range(-(-n // 8))), 1
    batch = ScheduledBatch(0, (ScheduledSequence(s, 0, n, True),))
    assert runner.prefill_graphs is not None and runner.prefill_graphs.can_run(batch)
    graphed_id = runner.step(batch).token_ids
    graphed = runner.workspace["logits"][:1].clone()
    assert runner.prefill_graphs.replays == 1
    runner.prefill_graphs = None  # the same step eagerly (it rewrites the same KV slots)
    eager_id = runner.step(batch).token_ids
    eager = runner.workspace["logits"][:1].clone()
    assert graphed_id == eager_id
    # cuBLAS may pick another kernel for the padded row count: bf16-level agreement
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
