"""PrefillGraphs on CPU: a one-sequence prefill step replayed from its token-count bucket
(padded rows, fixed attention grid, staged layout) computes what the eager step computes;
only eligible steps take it; bad buckets and settings are refused. The capture itself
(torch.cuda.graph) runs only on the GPU (tests/cuda/test_cuda_prefill_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.runner import EagerPrefillGraphs, drive, make_runner, new_seq, prompts
from llmc.base.errors import ConfigError, EngineError
from llmc.runtime.engine_runtime import RuntimeConfig
from llmc.runtime.prefill_graphs import PrefillGraphs, prefill_buckets
from llmc.runtime.types import RequestFault, ScheduledBatch, ScheduledSequence

LENGTHS = [5, 12, 16, 18, 31]  # chunked by 8: last chunks of 5, 4, 8, 2, 7 tokens


def _one_by_one(runner, spec, chunk: int, **sampling) -> dict[int, list[int]]:
    """Each prompt run alone (so its prefill steps hold one sequence), 6 tokens each."""
    out = {}
    for i, p in enumerate(prompts(len(LENGTHS), LENGTHS, spec.vocab_size, seed=7)):
        seq = new_seq(i, p, 6, **sampling)
        out.update(drive(runner, [seq], chunk=chunk, budget=64).outputs)
    return out


def _with_graphs(spec, weights, buckets=(16, 32)):
    runner = make_runner(spec, weights)
    calls: list[int] = []

    def forward(inp):
        calls.append(inp.num_tokens)
        return runner.forward(inp)

    graphs = EagerPrefillGraphs(runner.inputs, forward, runner.backend, buckets, allow_cpu=True)
    graphs.capture()
    runner.prefill_graphs = graphs
    return runner, graphs, calls


@pytest.mark.parametrize(
    "chunk, sampling",
    [(64, {}), (8, {}), (64, {"temperature": 0.9, "top_k": 20, "seed": 4})],
    ids=["whole-prompt", "chunked", "seeded"],
)
def test_prefill_graph_path_equals_eager(tiny_llama_weights, chunk, sampling) -> None:
    spec, weights = tiny_llama_weights
    eager = _one_by_one(make_runner(spec, weights), spec, chunk, **sampling)
    runner, graphs, calls = _with_graphs(spec, weights)
    got = _one_by_one(runner, spec, chunk, **sampling)
    assert got == eager
    # every prompt's last chunk is one replay: the bucket's padded size, never its own
    assert graphs.replays == len(LENGTHS) and len(calls) == graphs.replays
    assert set(calls) <= {16, 32}
    if chunk == 8:  # the last chunks start after earlier (eager) chunks: positions > 0
        assert calls.count(16) == len(LENGTHS)


def test_prefill_graph_logits_equal_eager(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    p = prompts(1, [13], spec.vocab_size, seed=2)[0]
    eager = drive(make_runner(spec, weights), [new_seq(0, p, 1)], chunk=64, budget=64)
    runner, graphs, _ = _with_graphs(spec, weights)
    seq = new_seq(0, p, 1)
    drive(runner, [seq], chunk=64, budget=64)
    assert graphs.replays == 1 and seq.output_token_ids == eager.outputs[0]
    # the replayed step's logits row is the eager step's (the same ops; a matmul over more
    # rows may sum in another order)
    big_logits = runner.workspace["logits"][:1].clone()
    runner.prefill_graphs = None
    again = new_seq(0, p, 1)
    drive(runner, [again], chunk=64, budget=64)
    torch.testing.assert_close(runner.workspace["logits"][:1], big_logits, rtol=1e-5, atol=1e-5)


def _prefill_batch(spec, n=12, *, n_seqs=1, sample=True, **sampling):
    seqs = []
    for i, p in enumerate(prompts(n_seqs, [n], spec.vocab_size, seed=5)):
        s = new_seq(i, p, 4, **sampling)
        s.block_table, s.block_table_version = list(range(4 * i, 4 * i + 4)), 1
        seqs.append(s)
    return ScheduledBatch(0, tuple(ScheduledSequence(s, 0, n, sample) for s in seqs))


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"n_seqs": 2}, "two sequences"),
        ({"sample": False}, "a chunk that does not end the prompt"),
        ({"n": 40}, "more tokens than the largest bucket"),
        ({"logprobs": 2}, "logprobs: not plain"),
        ({"prompt_logprobs": 1}, "prompt logprobs"),
        ({"repetition_penalty": 1.3}, "penalties: not plain"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_ineligible_steps_run_eagerly(tiny_llama_weights, kw, reason) -> None:
    spec, weights = tiny_llama_weights
    _, graphs, _ = _with_graphs(spec, weights)
    assert graphs.can_run(_prefill_batch(spec))
    kw = dict(kw)
    args = {k: kw.pop(k) for k in ("n_seqs", "sample", "n") if k in kw}
    assert not graphs.can_run(_prefill_batch(spec, **args, **kw)), reason


def test_small_steps_stay_on_the_fused_path(tiny_llama_weights) -> None:
    """A backend with fused small steps keeps steps of up to that many tokens eager."""
    spec, weights = tiny_llama_weights
    runner = make_runner(spec, weights)
    runner.backend.fused_decode_max_tokens = 4
    graphs = EagerPrefillGraphs(
        runner.inputs, runner.forward, runner.backend, (16,), allow_cpu=True
    )
    graphs.capture()
    assert not graphs.can_run(_prefill_batch(spec, n=4))
    assert graphs.can_run(_prefill_batch(spec, n=5))
    with pytest.raises(ConfigError, match=r"bucket 4 is outside \(4, max_num_tokens=128\]"):
        PrefillGraphs(runner.inputs, runner.forward, runner.backend, (4,), allow_cpu=True)


def test_bad_buckets_and_devices_are_refused(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    runner = make_runner(spec, weights)
    with pytest.raises(ConfigError, match="bucket 256 is outside"):
        PrefillGraphs(runner.inputs, runner.forward, runner.backend, (16, 256), allow_cpu=True)
    with pytest.raises(ConfigError, match="need a CUDA device"):
        PrefillGraphs(runner.inputs, runner.forward, runner.backend, (16,))


def test_a_token_outside_the_vocabulary_fails_its_request(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    _, graphs, _ = _with_graphs(spec, weights)
    batch = _prefill_batch(spec)
    batch.sequences[0].seq.prompt_token_ids[3] = spec.vocab_size
    assert graphs.can_run(batch)
    with pytest.raises(RequestFault, match="outside the vocabulary") as e:
        graphs.stage(batch)
    assert e.value.request_id == 0


def test_a_moved_staging_layout_is_refused(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    _, graphs, _ = _with_graphs(spec, weights)
    batch = _prefill_batch(spec)
    assert graphs.stage(batch) == 16
    graphs._layout[16][0] = ("input_ids", 0, 16, torch.int64)  # as if captured elsewhere
    with pytest.raises(EngineError, match="staging layout changed since capture"):
        graphs.stage(batch)


def test_default_buckets() -> None:
    assert prefill_buckets(512, 4, 8192) == (16, 32, 64, 128, 256, 512)
    assert prefill_buckets(512, 4, 200) == (16, 32, 64, 128, 200)
    assert prefill_buckets(100, 0, 8192) == (16, 32, 64, 100)
    assert prefill_buckets(0, 4, 8192) == ()
    assert prefill_buckets(16, 16, 8192) == ()


@pytest.mark.parametrize("bad", [-1, True, 2.5, "64"])
def test_prefill_graph_max_tokens_is_checked(bad) -> None:
    with pytest.raises(ConfigError, match="prefill_graph_max_tokens must be an integer >= 0"):
        RuntimeConfig(prefill_graph_max_tokens=bad)
    assert RuntimeConfig(prefill_graph_max_tokens=0).prefill_graph_max_tokens == 0
