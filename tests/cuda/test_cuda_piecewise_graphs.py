"""On the GPU: prefill batches and mixed steps whose layers replay as captured pieces
(llmc.runtime.piecewise_graphs, the attentions launched between them) give the eager steps'
tokens (float32 tiny models, greedy and seeded, chunked prefill) and bf16 logits close to the
eager ones (SmolLM2 shape: the tensor-core / sm90 prefill kernels), and really replay."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import SMOLLM2, load_engine_weights
from helpers.runner import generate_checked, gpu_runtime, prefill_batch
from llmc.compiler.dummy import dummy_weights
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    return load_engine_weights(request.getfixturevalue(f"tiny_{request.param}_dir"))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=8, ignore_eos=True),
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("max_num_tokens", [128, 48], ids=["whole", "chunked"])
def test_piecewise_graphs_give_the_eager_tokens(model, sampling, max_num_tokens) -> None:
    lengths = (3, 11, 25, 40, 1, 17, 33, 9)
    rt = gpu_runtime(
        model, max_num_tokens=max_num_tokens, piecewise_graph_max_tokens=max_num_tokens
    )
    pw = rt.runner.piecewise
    assert pw is not None and pw.buckets[-1] == max_num_tokens
    assert rt.summary()["piecewise_graph_buckets"] == list(pw.buckets)
    got, _ = generate_checked(rt, sampling, lengths)
    assert pw.replays > 0
    eager = gpu_runtime(model, max_num_tokens=max_num_tokens)
    assert eager.runner.piecewise is None  # off by default
    ref, _ = generate_checked(eager, sampling, lengths)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_bf16_piecewise_logits_close_to_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    w = dummy_weights(SMOLLM2, "bfloat16", seed=2, device="cuda")
    rt = gpu_runtime((SMOLLM2, w), dtype="bfloat16", piecewise_graph_max_tokens=128)
    runner = rt.runner
    assert runner.piecewise is not None
    batch = prefill_batch((12, 37, 5, 60), SMOLLM2.vocab_size, 8)  # 114 tokens, 4 sequences
    graphed = runner.forward_logits(batch)
    assert runner.piecewise.replays == 1
    runner.piecewise = None  # the same step eagerly (it rewrites the same KV slots)
    eager = runner.forward_logits(batch)
    assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
