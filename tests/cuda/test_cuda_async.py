"""On the GPU: async scheduling (the default on CUDA) gives token-for-token the output of the
synchronous loop, with the CUDA backend and CUDA graphs, for greedy and seeded sampling,
stop tokens that end requests mid-stream, and forced preemption; and it really overlaps."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import load_engine_weights
from helpers.runner import generate_checked, gpu_runtime
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")

    return load_engine_weights(tiny_llama_dir)


def _run(model, sampling, *, async_scheduling, graphs=True, num_blocks=64, policy=None):
    rt = gpu_runtime(
        model,
        num_blocks=num_blocks,
        cuda_graphs=graphs,
        async_scheduling=async_scheduling,
        scheduler_policy=policy or "guaranteed_no_evict",
    )
    assert rt.async_scheduling is async_scheduling
    return generate_checked(rt, sampling)


def _same(model, sampling, **kw):
    sync, ex_s = _run(model, sampling, async_scheduling=False, **kw)
    asyn, ex_a = _run(model, sampling, async_scheduling=True, **kw)
    assert [o.token_ids for o in asyn] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in asyn] == [o.finish_reason for o in sync]
    assert ex_s.num_ahead_steps == 0 and ex_a.num_ahead_steps > 0
    return sync


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_async_equals_sync_greedy_and_seeded(model, graphs):
    sp = [
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=9, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, ignore_eos=True),
        SamplingParams(max_new_tokens=16, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0.7, seed=1, ignore_eos=True),
    ]
    _same(model, sp, graphs=graphs)


def test_async_equals_sync_stop_tokens_mid_stream(model):
    ref = _same(model, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 5)
    sp = [
        SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(o.token_ids[2 + i],))
        for i, o in enumerate(ref)
    ]
    _same(model, sp)


def test_async_equals_sync_under_preemption(model):
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 20, 30, 16, 28)]
    roomy, _ = _run(model, sp, async_scheduling=False)
    tight, ex = _run(model, sp, async_scheduling=True, num_blocks=14, policy="max_utilization")
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert sum(r.num_preempted for r in ex.step_records) > 0
