"""DecodeGraphs on CPU: built from its collaborators alone (the StepInputBuilder, a forward
callable, a backend), it computes what the eager path computes, calls the forward once per
replay with its bucket's padded inputs, refuses a staging layout that moved since capture,
and needs a CUDA device unless told otherwise. The capture itself (torch.cuda.graph) runs
only on the GPU (tests/cuda/test_cuda_e2e.py, tests/cuda/test_cuda_async.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.runner import EagerGraphs, drive, make_runner, new_seq, prompts
from llmc.base.errors import ConfigError, EngineError
from llmc.runtime.cuda_graphs import DecodeGraphs
from llmc.runtime.types import ScheduledBatch, ScheduledSequence


def _seqs(spec):
    sps = [{}, {"temperature": 0.9, "top_k": 20, "seed": 4}, {}]
    ps = prompts(3, [5, 12, 9], spec.vocab_size, seed=3)
    return [new_seq(i, p, 6, **sps[i]) for i, p in enumerate(ps)]


def test_graph_path_equals_eager_from_explicit_collaborators(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    eager = drive(make_runner(spec, weights), _seqs(spec), chunk=16, budget=64).outputs
    runner = make_runner(spec, weights)
    calls: list[int] = []

    def forward(inp):
        calls.append(inp.num_tokens)
        return runner.forward(inp)

    graphs = EagerGraphs(runner.inputs, forward, runner.backend, (1, 2, 4), allow_cpu=True)
    graphs.capture()
    assert graphs.graphs.keys() == {1, 2, 4} and calls == []  # no warm-up in this capture
    runner.graphs = graphs
    got = drive(runner, _seqs(spec), chunk=16, budget=64).outputs
    assert got == eager
    assert graphs.replays > 0 and len(calls) == graphs.replays
    assert set(calls) <= {1, 2, 4}  # the bucket's padded size, never the batch's own


def test_a_moved_staging_layout_is_refused(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    runner = make_runner(spec, weights)
    graphs = EagerGraphs(runner.inputs, runner.forward, runner.backend, (2,), allow_cpu=True)
    graphs.capture()
    seqs = _seqs(spec)[:2]
    for s in seqs:
        s.block_table, s.block_table_version = [0, 1], 1
        s.output_token_ids, s.num_computed_tokens = [3], s.num_prompt_tokens
    batch = ScheduledBatch(
        0, tuple(ScheduledSequence(s, s.num_prompt_tokens, 1, True) for s in seqs)
    )
    assert graphs.can_run(batch)
    assert graphs.stage(batch) == (2, 2)
    graphs._layout[2][0] = ("input_ids", 0, 2, torch.int64)  # as if captured elsewhere
    with pytest.raises(EngineError, match="staging layout changed since capture"):
        graphs.stage(batch)


def test_graphs_need_cuda_and_valid_buckets(tiny_llama_weights) -> None:
    spec, weights = tiny_llama_weights
    runner = make_runner(spec, weights, max_batch_size=8)
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(runner.inputs, runner.forward, runner.backend)
    with pytest.raises(ConfigError, match="bucket 9 is outside"):
        DecodeGraphs(runner.inputs, runner.forward, runner.backend, (4, 9), allow_cpu=True)
    g = DecodeGraphs(runner.inputs, runner.forward, runner.backend, allow_cpu=True)
    assert g.buckets == (1, 2, 4, 8) and not g.can_run(ScheduledBatch(0, ()))
    plain = ScheduledSequence(_seqs(spec)[0], 0, 1, True)
    assert not g.can_run(ScheduledBatch(0, (plain,)))  # nothing captured yet
