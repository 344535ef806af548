"""On the GPU: multi-step decoding (``decode_steps_per_iteration`` K > 1: K replays of the
decode CUDA graph chained by the captured token feedback, one copy of the ids at the end)
gives token-for-token the output of one step per iteration, and the CUDA backend's K-step
tokens equal the torch backend's, on fp32 weights: greedy and seeded sampling, stop ids and
max_tokens inside a window, forced preemption, with CUDA graphs on and off, and the torch
backend's device-tensor loop on the GPU."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import load_engine_weights
from helpers.runner import generate_checked, gpu_runtime
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.cuda

K = 4


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    return load_engine_weights(tiny_llama_dir)


def _run(model, sampling, *, steps, backend="cuda", graphs=True, num_blocks=64, policy=None):
    rt = gpu_runtime(
        model,
        backend=backend,
        num_blocks=num_blocks,
        cuda_graphs=graphs,
        scheduler_policy=policy or "guaranteed_no_evict",
        decode_steps_per_iteration=steps,
    )
    outs, ex = generate_checked(rt, sampling)
    windows = sum(1 for r in ex.step_records if r.num_steps > 1)
    assert (windows > 0) is (steps > 1), windows
    if steps > 1 and graphs and backend == "cuda":
        assert rt.runner.graphs.advance_graphs, "the token feedback was not captured"
    return outs


def _same(model, sampling, **kw):
    one = _run(model, sampling, steps=1, **kw)
    multi = _run(model, sampling, steps=K, **kw)
    assert [o.token_ids for o in multi] == [o.token_ids for o in one]
    assert [o.finish_reason for o in multi] == [o.finish_reason for o in one]
    return one


SAMPLED = [
    SamplingParams(max_new_tokens=24, ignore_eos=True),
    SamplingParams(max_new_tokens=9, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
    SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, seed=2, ignore_eos=True),
    SamplingParams(max_new_tokens=15, ignore_eos=True),
    SamplingParams(max_new_tokens=6, temperature=0.7, min_p=0.1, seed=1, ignore_eos=True),
]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_multi_step_equals_single_step_greedy_and_seeded(model, graphs):
    _same(model, SAMPLED, graphs=graphs)


def test_multi_step_cuda_backend_equals_torch_backend(model):
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 9, 30, 15, 6)]
    cuda = _run(model, greedy, steps=K)
    ref = _run(model, greedy, steps=1, backend="torch", graphs=False)
    assert [o.token_ids for o in cuda] == [o.token_ids for o in ref]


def test_multi_step_torch_backend_on_the_gpu_equals_single_step(model):
    _same(model, SAMPLED, backend="torch", graphs=False)


def test_multi_step_stop_ids_inside_a_window(model):
    ref = _same(model, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 5)
    sp = [
        SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(o.token_ids[2 + i],))
        for i, o in enumerate(ref)
    ]
    out = _same(model, sp)
    assert all(o.finish_reason.value == "stop" for o in out)


def test_multi_step_under_preemption(model):
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 20, 30, 16, 28)]
    roomy = _run(model, sp, steps=1)
    tight = _run(model, sp, steps=K, num_blocks=14, policy="max_utilization")
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_a_window_launch_never_synchronizes_with_the_device(model):
    """Between a window's K graph replays and its token feedback the host never waits for
    the device: torch's sync debug mode turns any implicit synchronisation into an error."""
    rt = gpu_runtime(model, decode_steps_per_iteration=K)
    runner, launched = rt.runner, []
    inner = runner._launch_window

    def checked(batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launched.append(batch.window.num_steps)

    runner._launch_window = checked
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 9, 30, 15, 6)]
    outs, _ = generate_checked(rt, sp, lengths=(5, 9, 3, 7, 2), seed=1)
    assert [len(o.token_ids) for o in outs] == [24, 9, 30, 15, 6]
    assert launched and max(launched) == K
