"""PiecewiseGraphs on CPU: prefill batches and mixed steps whose layers run as pieces of a
padded token-count bucket, with the attentions (over the real metadata) between them, give
the eager steps' tokens, logits (to float rounding) and logprobs; rows past the step's
tokens never write the KV cache; bad buckets and settings are refused. The capture itself
(CUDAGraph.capture_begin / capture_end per piece) runs only on the GPU
(tests/cuda/test_cuda_piecewise_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.runner import EagerPiecewiseGraphs, drive, make_runner, new_seq, prompts
from llmc.base.errors import ConfigError
from llmc.runtime.engine_runtime import RuntimeConfig
from llmc.runtime.piecewise_graphs import PiecewiseGraphs, piecewise_buckets

LENGTHS = [5, 12, 9, 30, 17, 3]


def _seqs(spec, **sampling):
    ps = prompts(len(LENGTHS), LENGTHS, spec.vocab_size, seed=11)
    return [new_seq(i, p, 7, **sampling) for i, p in enumerate(ps)]


def _with_pieces(spec, weights, buckets=(16, 32, 64)):
    runner = make_runner(spec, weights)
    pw = EagerPiecewiseGraphs(runner.inputs, runner.embed, runner.layers, buckets, allow_cpu=True)
    pw.capture()
    runner.piecewise = pw
    return runner, pw


@pytest.mark.parametrize(
    "sampling",
    [{}, {"temperature": 0.9, "top_k": 20, "seed": 4}, {"repetition_penalty": 1.2}],
    ids=["greedy", "seeded", "penalties"],
)
@pytest.mark.parametrize("chunk, budget", [(64, 64), (8, 24)], ids=["whole", "chunked"])
def test_piecewise_path_equals_eager(tiny_llama_weights, sampling, chunk, budget) -> None:
    spec, weights = tiny_llama_weights
    eager = drive(make_runner(spec, weights), _seqs(spec, **sampling), chunk=chunk, budget=budget)
    runner, pw = _with_pieces(spec, weights)
    got = drive(runner, _seqs(spec, **sampling), chunk=chunk, budget=budget, start_every=2)
    again = drive(
        make_runner(spec, weights),
        _seqs(spec, **sampling),
        chunk=chunk,
        budget=budget,
        start_every=2,
    )
    assert got.outputs == again.outputs  # the same schedule, piecewise and eager
    assert pw.replays > 0 and got.mixed_steps > 0  # mixed prefill + decode steps ran piecewise
    if not sampling or "seed" in sampling:  # (batch-invariant sampling: any schedule)
        assert got.outputs == eager.outputs


def test_piecewise_logits_equal_eager(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    ref = drive(make_runner(spec, weights), _seqs(spec), chunk=8, budget=24, record_logits=True)
    runner, pw = _with_pieces(spec, weights)
    got = drive(runner, _seqs(spec), chunk=8, budget=24, record_logits=True)
    assert pw.replays > 0 and ref.logits.keys() == got.logits.keys()
    for key, row in ref.logits.items():  # (a matmul over more rows may sum in another order)
        torch.testing.assert_close(got.logits[key], row, rtol=1e-5, atol=1e-5)


def test_padding_rows_never_write_the_cache(tiny_llama_weights) -> None:
    """A big step then a small one in the same bucket: the rows past the small step's
    tokens held the big step's slots; they must be cleared, not written again."""
    spec, weights = tiny_llama_weights
    runner, pw = _with_pieces(spec, weights, buckets=(64,))
    seqs = _seqs(spec)
    drive(runner, seqs[:4], chunk=64, budget=64)  # one 56-token prefill step, then decodes
    before = runner.kv_cache.storage.clone()
    ws = runner.workspace
    assert bool((ws["slot_mapping"][4:64] == -1).all())  # cleared by the 4-row decode steps
    small = [new_seq(9, seqs[4].prompt_token_ids[:10], 1)]
    drive(runner, small, chunk=64, budget=64)
    changed = (runner.kv_cache.storage != before).flatten(4).any(-1)  # [L, 2, blocks, tpb]
    # only the small request's 10 prompt tokens were written (its blocks came fresh from a
    # new allocator, so they overlap the first request's: compare counts, not places)
    assert int(changed[0, 0].sum()) == 10


def test_prompt_logprobs_and_logprobs_run_piecewise(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    kw = {"logprobs": 2, "prompt_logprobs": 1}
    eager = drive(make_runner(spec, weights), _seqs(spec, **kw), chunk=64, budget=64)
    runner, pw = _with_pieces(spec, weights)
    got = drive(runner, _seqs(spec, **kw), chunk=64, budget=64)
    assert pw.replays > 0 and got.outputs == eager.outputs


def test_steps_outside_the_buckets_run_eagerly(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    runner, pw = _with_pieces(spec, weights, buckets=(16,))
    seqs = _seqs(spec)[:2]  # 5 + 12 = 17 tokens: above the only bucket
    drive(runner, seqs, chunk=64, budget=64)
    first = pw.replays
    assert first > 0  # the 2-row decode steps did run piecewise (2 <= 16)
    runner.backend.fused_decode_max_tokens = 4
    pw2 = EagerPiecewiseGraphs(runner.inputs, runner.embed, runner.layers, (16,), allow_cpu=True)
    pw2.capture()
    runner.piecewise = pw2
    drive(runner, _seqs(spec)[:2], chunk=64, budget=64)
    assert pw2.replays == 0  # 17 tokens: eager; 2-row decodes: the fused small-step path


def test_bad_buckets_devices_and_tensor_parallel_are_refused(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    r = make_runner(spec, weights)
    with pytest.raises(ConfigError, match=r"bucket 256 is outside \(1, max_num_tokens=128\]"):
        PiecewiseGraphs(r.inputs, r.embed, r.layers, (16, 256), allow_cpu=True)
    with pytest.raises(ConfigError, match="need a CUDA device"):
        PiecewiseGraphs(r.inputs, r.embed, r.layers, (16,))
    r.layers.reduce = lambda t: None
    with pytest.raises(ConfigError, match="tensor-parallel"):
        PiecewiseGraphs(r.inputs, r.embed, r.layers, (16,), allow_cpu=True)


def test_default_buckets() -> None:
    assert piecewise_buckets(8192, 4, 8192)[:7] == (16, 32, 64, 128, 256, 512, 768)
    assert piecewise_buckets(8192, 4, 8192)[-2:] == (7936, 8192)
    assert len(piecewise_buckets(8192, 4, 8192)) == 5 + 31
    assert piecewise_buckets(1000, 4, 8192) == (16, 32, 64, 128, 256, 512, 768, 1000)
    assert piecewise_buckets(8192, 0, 100) == (16, 32, 64, 100)
    assert piecewise_buckets(0, 4, 8192) == ()


@pytest.mark.parametrize("bad", [-1, True, 2.5, "64"])
def test_piecewise_graph_max_tokens_is_checked(bad) -> None:
    with pytest.raises(ConfigError, match="piecewise_graph_max_tokens must be an integer >= 0"):
        RuntimeConfig(piecewise_graph_max_tokens=bad)
    assert RuntimeConfig().piecewise_graph_max_tokens == 0
