"""Beam search and n / best_of samples on the GPU: the CUDA backend's beams (kernels, CUDA
graphs for the plain rows, async scheduling on) equal the torch reference backend's on the
same fp32 weights (tiny Llama / Qwen2, SmolLM2 dimensions with random weights): the same
sequences, their summed logprobs within fp32 tolerance, alone and in a batch with greedy and
sampled requests, with chunked prefill and under preemption; the KV pool is free after.
The beam bookkeeping (log-softmax, top-2k) runs on the device: the step's logits workspace
is poisoned with NaN before the run, so a row read before it is written fails the test."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from helpers.engines import SMOLLM2, load_engine_weights, make_limits
from llmc.compiler.dummy import dummy_weights
from llmc.compiler.spec import ModelSpec
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.cuda

NEW = 16


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


@pytest.fixture(scope="module", params=["llama", "qwen2", "smollm2"])
def model(request):
    if request.param == "smollm2":
        return SMOLLM2, dummy_weights(SMOLLM2, "float32", seed=0, device="cuda")
    return load_engine_weights(request.getfixturevalue(f"tiny_{request.param}_dir"))


def _prompts(vocab: int, lengths=(3, 11, 25, 40), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _run(
    spec: ModelSpec,
    weights: dict[str, torch.Tensor],
    backend: str,
    params: list[SamplingParams],
    *,
    max_num_tokens: int = 128,
    num_blocks: int = 96,
    policy: str = "guaranteed_no_evict",
) -> tuple[list[Any], list[Any]]:
    limits = make_limits(max_batch_size=16, max_input_len=64, max_seq_len=128,
                         max_num_tokens=max_num_tokens, tokens_per_block=8,
                         max_beam_width=4)  # fmt: skip
    config = RuntimeConfig(device="cuda", backend=backend, cuda_graphs=backend == "cuda",
                           scheduler_policy=policy, enable_block_reuse=False)  # fmt: skip
    rt = EngineRuntime.from_weights(spec, weights, limits=limits, num_kv_blocks=num_blocks,
                                    device="cuda", backend=backend, config=config)  # fmt: skip
    rt.runner.workspace["logits"].fill_(float("nan"))
    ex = rt.executor()
    outs = ex.generate(_prompts(spec.vocab_size)[: len(params)], params)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks
    rt.kv.check_invariants()
    return outs, ex.step_records


def _beams(k: int, penalty: float = 1.0, early: bool | str = False) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, use_beam_search=True, beam_width=k, n=k,
                          length_penalty=penalty, early_stopping=early)  # fmt: skip


def _assert_same(ours: list[Any], ref: list[Any]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a.completions is None:
            assert a.token_ids == b.token_ids, f"request {i}"
            continue
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions], (
            f"request {i}"
        )
        for x, y in zip(a.completions, b.completions, strict=True):
            if x.cumulative_logprob is not None:
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("k", [2, 4])
def test_beams_cuda_equal_torch(model, k):
    spec, w = model
    params = [_beams(k), _beams(k, 0.5, True), _beams(k, 2.0, "never"), _beams(k)]
    ref, _ = _run(spec, w, "torch", params)
    ours, _ = _run(spec, w, "cuda", params)
    _assert_same(ours, ref)


def test_beams_and_samples_mixed_cuda_equal_torch(model):
    spec, w = model
    params = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True),
        _beams(4),
        SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=3, n=4, ignore_eos=True),
        SamplingParams(
            max_new_tokens=NEW, temperature=1.0, seed=4, n=2, best_of=3, ignore_eos=True
        ),  # fmt: skip
    ]
    ref, _ = _run(spec, w, "torch", params)
    ours, _ = _run(spec, w, "cuda", params)
    _assert_same(ours, ref)


def test_beams_cuda_equal_torch_chunked_and_preempted(model):
    spec, w = model
    params = [_beams(4)] * 4
    ref, _ = _run(spec, w, "torch", params)
    chunked, steps = _run(spec, w, "cuda", params, max_num_tokens=20)
    _assert_same(chunked, ref)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    preempted, steps = _run(spec, w, "cuda", params, num_blocks=28, policy="max_utilization")
    _assert_same(preempted, ref)
    assert sum(s.num_preempted for s in steps) > 0
