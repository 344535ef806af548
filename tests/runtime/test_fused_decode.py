"""The fused small-step decode ops (norm_linear, norm_gate_up_silu, linear_residual_add) on
the CPU: their references equal the unfused op sequence bit for bit, and a ModelRunner whose
TorchBackend runs steps of <= 8 tokens fused gives the same logits as the unfused runner."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import load_engine_weights
from helpers.runner import BlockAllocator, make_runner, new_seq, prompts
from llmc.base.errors import ConfigError
from llmc.cuda.torch_backend import TorchBackend
from llmc.runtime.types import ScheduledBatch, ScheduledSequence

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rand(*shape, dtype, scale=1.0, g):
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_fused_ops_equal_unfused_sequence(dtype, m):
    """Each fused op vs the unfused TorchBackend ops it replaces in the runner."""
    g = torch.Generator().manual_seed(m)
    k, n, i = 72, 40, 24
    be = TorchBackend()
    residual = _rand(m, k, dtype=dtype, scale=3.0, g=g)
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    w = _rand(n, k, dtype=dtype, scale=0.1, g=g)
    bias = _rand(n, dtype=dtype, g=g)
    gu = _rand(2 * i, k, dtype=dtype, scale=0.1, g=g)
    x = _rand(m, k, dtype=dtype, g=g)
    eps = 1e-5
    normed = be.rms_norm(residual, norm_w, eps, out=torch.empty(m, k, dtype=dtype))
    for b in (None, bias):
        want = be.linear(normed, w, b, out=torch.empty(m, n, dtype=dtype))
        got = be.norm_linear(residual, norm_w, eps, w, b, out=torch.empty(m, n, dtype=dtype))
        assert torch.equal(got, want)
        assert torch.equal(be.norm_linear(residual, norm_w, eps, w, b), want)  # no out
    gate_up = be.linear(normed, gu, out=torch.empty(m, 2 * i, dtype=dtype))
    want = be.silu_and_mul(gate_up, out=torch.empty(m, i, dtype=dtype))
    got = be.norm_gate_up_silu(residual, norm_w, eps, gu, out=torch.empty(m, i, dtype=dtype))
    assert torch.equal(got, want)
    # linear + residual add: the unfused path adds the rounded GEMM output in add_rms_norm
    wo = _rand(k, k, dtype=dtype, scale=0.1, g=g)
    res_unfused, res_fused = residual.clone(), residual.clone()
    proj = be.linear(x, wo, out=torch.empty(m, k, dtype=dtype))
    be.add_rms_norm(proj, res_unfused, norm_w, eps, out=torch.empty(m, k, dtype=dtype))
    back = be.linear_residual_add(x, wo, res_fused)
    assert back is res_fused
    assert torch.equal(res_fused, res_unfused)
    assert not torch.equal(res_fused, residual)


def test_fused_decode_max_tokens_is_checked():
    assert TorchBackend().fused_decode_max_tokens == 0
    assert TorchBackend(fused_decode_max_tokens=8).fused_decode_max_tokens == 8
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ConfigError, match="fused_decode_max_tokens"):
            TorchBackend(fused_decode_max_tokens=bad)


class CountingBackend(TorchBackend):
    """TorchBackend that records, per step, the token count and whether it ran fused."""

    def __init__(self, fused: int) -> None:
        super().__init__("cpu", fused_decode_max_tokens=fused)
        self.steps: list[tuple[int, bool]] = []

    def embedding(self, ids, table, out=None):
        self.steps.append((ids.shape[0], False))
        return super().embedding(ids, table, out)

    def norm_linear(self, residual, *args, **kw):
        self.steps[-1] = (self.steps[-1][0], True)
        return super().norm_linear(residual, *args, **kw)


def _run_schedule(runner, spec):
    """A fixed schedule: 8 prompts prefilled in chunks beside decodes (steps > 8 tokens),
    then decode-only steps of 8, 7, 6, 5, 4, 4, 3, 2, 1 sequences as they finish, and one 5-token
    prefill alone. Returns {(request, step): logits row} and the greedy ids."""
    alloc = BlockAllocator(runner.kv_cache.num_blocks, runner.limits.tokens_per_block)
    lengths = [3, 11, 6, 20, 1, 9, 14, 2]
    seqs = [
        new_seq(i, p, 3 + i) for i, p in enumerate(prompts(8, lengths, spec.vocab_size, seed=5))
    ]
    late = new_seq(8, prompts(1, [5], spec.vocab_size, seed=6)[0], 2)
    logits: dict[tuple[int, int], torch.Tensor] = {}
    step = 0

    def run(sched):
        nonlocal step
        for x in sched:
            alloc.ensure(x.seq, x.start_position + x.num_new_tokens)
        out = runner.forward_logits(ScheduledBatch(step_id=step, sequences=tuple(sched)))
        sampled = [x for x in sched if x.sample]
        for x, row in zip(sampled, out, strict=True):
            logits[(x.seq.request_id, step)] = row
            x.seq.output_token_ids.append(int(row.argmax()))
        for x in sched:
            x.seq.num_computed_tokens += x.num_new_tokens
        step += 1

    # prefill: sequences 0..3 first, then 4..7 beside the decodes of 0..3
    run([ScheduledSequence(s, 0, s.num_tokens, True) for s in seqs[:4]])
    dec = [ScheduledSequence(s, s.num_computed_tokens, 1, True) for s in seqs[:4]]
    run(dec + [ScheduledSequence(s, 0, s.num_tokens, True) for s in seqs[4:]])
    while any(len(s.output_token_ids) < s.max_new_tokens for s in seqs):
        live = [s for s in seqs if len(s.output_token_ids) < s.max_new_tokens]
        run([ScheduledSequence(s, s.num_computed_tokens, 1, True) for s in live])
    run([ScheduledSequence(late, 0, late.num_tokens, True)])
    return logits, {s.request_id: s.output_token_ids for s in [*seqs, late]}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_runner_fused_steps_match_unfused(arch, request):
    """float32 logits of every step (1..8-token fused steps, > 8-token mixed steps unfused)
    and the greedy ids are identical with fused_decode_max_tokens = 8 and 0."""
    ckpt = request.getfixturevalue(f"tiny_{arch}_dir")
    spec, weights = load_engine_weights(ckpt)
    results = {}
    for fused in (0, 8):
        be = CountingBackend(fused)
        runner = make_runner(spec, weights, backend=be, max_num_tokens=96, max_batch_size=8)
        results[fused] = _run_schedule(runner, spec), be.steps
    (logits0, ids0), steps0 = results[0]
    (logits8, ids8), steps8 = results[8]
    assert not any(f for _, f in steps0)
    assert [t for t, _ in steps0] == [t for t, _ in steps8]
    assert {t for t, f in steps8 if f} == set(range(1, 9))  # every fused size ran
    assert all(t <= 8 for t, f in steps8 if f) and any(t > 8 for t, f in steps8 if not f)
    assert ids0 == ids8
    assert logits0.keys() == logits8.keys()
    for key, row in logits0.items():
        assert torch.equal(row, logits8[key]), key
