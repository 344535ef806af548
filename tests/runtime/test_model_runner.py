"""ModelRunner + TorchBackend against HF transformers on the tiny Llama and Qwen2 fixtures."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import load_engine_weights, make_limits
from helpers.fakes import make_scheduler
from helpers.runner import (
    BlockAllocator,
    drive,
    hf_greedy,
    hf_logits,
    load_hf,
    make_runner,
    new_seq,
    prompts,
)
from llmc.base.errors import ConfigError, EngineError, RequestError
from llmc.compiler.memory_plan import arena_bytes, plan_workspace
from llmc.runtime.types import ScheduledBatch, ScheduledSequence
from llmc.runtime.workspace import TORCH_DTYPES

LENGTHS = [37, 5, 70, 1, 18]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    ckpt = request.getfixturevalue(f"tiny_{request.param}_dir")
    spec, weights = load_engine_weights(ckpt)
    return spec, weights, load_hf(ckpt)


def _check_logits(model, seqs, res, tol=1e-4):
    assert res.logits
    for s in seqs:
        ref = hf_logits(model, s.all_token_ids)
        for (rid, pos), row in res.logits.items():
            if rid == s.request_id:
                torch.testing.assert_close(row, ref[pos], atol=tol, rtol=0)


@pytest.mark.parametrize("chunk", [1000, 1, 16, 64])
def test_logits_match_hf_prefill_chunks(tiny, chunk):
    """(a) one prefill step for the whole batch, (b) chunks of 1, 16 and 64 tokens."""
    spec, weights, model = tiny
    runner = make_runner(spec, weights, max_num_tokens=256)
    seqs = [new_seq(i, p, 3) for i, p in enumerate(prompts(5, LENGTHS, spec.vocab_size))]
    res = drive(runner, seqs, chunk=chunk, budget=256, record_logits=True)
    if chunk == 1000:
        assert len(res.logits) == 5 * 3  # every prompt prefilled in the first step
    _check_logits(model, seqs, res)


def test_logits_match_hf_mixed_with_decodes(tiny):
    """(c) decode tokens of running sequences share steps with prefill chunks of new ones."""
    spec, weights, model = tiny
    runner = make_runner(spec, weights, max_num_tokens=24)
    seqs = [new_seq(i, p, 8) for i, p in enumerate(prompts(5, LENGTHS, spec.vocab_size, 1))]
    res = drive(runner, seqs, chunk=16, budget=24, start_every=3, record_logits=True)
    assert res.mixed_steps >= 3
    _check_logits(model, seqs, res)


def test_greedy_matches_hf_generate(tiny):
    spec, weights, model = tiny
    runner = make_runner(spec, weights, max_num_tokens=32)
    ps = prompts(3, [11, 3, 29], spec.vocab_size, seed=2)
    seqs = [new_seq(i, p, 33) for i, p in enumerate(ps)]
    res = drive(runner, seqs, chunk=16, budget=32, start_every=2)
    for i, p in enumerate(ps):
        assert res.outputs[i] == hf_greedy(model, p, 33), f"prompt {i}"


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_end_to_end_with_scheduler(tiny, reuse):
    """The real Scheduler + KVCacheManager (prefix reuse, chunked prefill, preemption)."""
    from llmc.runtime.scheduler import MAX_UTILIZATION

    spec, weights, model = tiny
    tpb, blocks = 4, 24
    runner = make_runner(
        spec,
        weights,
        max_num_tokens=16,
        tokens_per_block=tpb,
        num_kv_blocks=blocks,
        max_seq_len=64,
    )
    sched = make_scheduler(
        blocks,
        policy=MAX_UTILIZATION,
        reuse=reuse,
        max_num_tokens=16,
        max_batch_size=8,
        max_seq_len=64,
        max_input_len=48,
        tokens_per_block=tpb,
    )
    base = prompts(1, [12], spec.vocab_size, seed=3)[0]
    ps = [base + [5, 6, 7], base + [9], prompts(1, [30], spec.vocab_size, seed=4)[0], base]
    seqs = [new_seq(i, p, 20) for i, p in enumerate(ps)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update(batch, runner.step(batch).token_ids)
        steps += 1
        assert steps < 500
    assert sched.stats().num_preemptions > 0
    assert (sched.kv.stats().reuse_hits > 0) == reuse
    assert sched.kv.num_free_blocks == blocks
    for s, p in zip(seqs, ps, strict=True):
        assert s.output_token_ids == hf_greedy(model, p, 20), f"request {s.request_id}"


def test_step_output_order_and_phase_times(tiny):
    spec, weights, _ = tiny
    runner = make_runner(spec, weights)
    ps = prompts(3, [9, 4, 13], spec.vocab_size, seed=5)
    alloc = BlockAllocator(runner.kv_cache.num_blocks, runner.limits.tokens_per_block)
    seqs = [new_seq(i, p, 4) for i, p in enumerate(ps)]
    for s in seqs:
        alloc.ensure(s, s.num_prompt_tokens)
    # prefill of seq 0 is split: its first chunk samples nothing
    sched = (
        ScheduledSequence(seqs[2], 0, 13, True),
        ScheduledSequence(seqs[0], 0, 5, False),
        ScheduledSequence(seqs[1], 0, 4, True),
    )
    out = runner.step(ScheduledBatch(0, sched))
    alone = [
        make_runner(spec, weights).forward_logits(ScheduledBatch(0, (x,))).argmax(-1).item()
        for x in (sched[0], sched[2])
    ]
    assert out.token_ids == alone
    assert set(out.phase_times) == {"prepare", "forward", "sample"}
    assert all(v >= 0 for v in out.phase_times.values())


def test_kv_cache_written_only_at_slots(tiny):
    spec, weights, _ = tiny
    runner = make_runner(spec, weights, tokens_per_block=4, num_kv_blocks=16)
    seq = new_seq(0, prompts(1, [6], spec.vocab_size)[0], 2)
    seq.block_table = [9, 3]
    runner.step(ScheduledBatch(0, (ScheduledSequence(seq, 0, 6, True),)))
    for layer in range(spec.num_layers):
        for cache in runner.kv_cache.layer(layer):
            written = cache.abs().sum((2, 3)) != 0  # [blocks, tokens_per_block]
            expect = torch.zeros_like(written)
            expect[9, :] = True
            expect[3, :2] = True
            assert torch.equal(written, expect)


def test_sampled_step_is_batch_independent(tiny):
    """A seeded sampled row gives the same tokens alone and inside a batch of other rows."""
    spec, weights, _ = tiny
    ps = prompts(3, [10, 6, 15], spec.vocab_size, seed=6)
    kw = dict(temperature=0.9, top_k=50, top_p=0.95, seed=1234)

    def run(indices):
        runner = make_runner(spec, weights)
        seqs = [new_seq(i, ps[i], 12, **(kw if i == 0 else {"temperature": 1.3})) for i in indices]
        return drive(runner, seqs, chunk=8, budget=64).outputs[0]

    assert run([0]) == run([0, 1, 2])


def test_logprobs_returned(tiny):
    spec, weights, model = tiny
    runner = make_runner(spec, weights)
    p = prompts(1, [8], spec.vocab_size, seed=7)[0]
    seq = new_seq(0, p, 1, logprobs=3)
    other = new_seq(1, p, 1)
    BlockAllocator(200, 8).ensure(seq, 8)
    other.block_table = [b + 100 for b in range(1)]
    batch = ScheduledBatch(
        0, (ScheduledSequence(seq, 0, 8, True), ScheduledSequence(other, 0, 8, True))
    )
    out = runner.step(batch)
    assert out.logprobs is not None and out.logprobs[1] is None
    lp = out.logprobs[0]
    ref = torch.log_softmax(hf_logits(model, p)[-1].double(), -1)
    assert lp.token_id == out.token_ids[0] == int(ref.argmax())
    assert abs(lp.logprob - float(ref.max())) < 1e-4
    top = ref.topk(3)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert max(abs(a - float(b)) for (_, a), b in zip(lp.top, top.values, strict=True)) < 1e-4


def test_bad_inputs(tiny):
    spec, weights, _ = tiny
    runner = make_runner(spec, weights, max_num_tokens=16, max_seq_len=32, tokens_per_block=4)
    seq = new_seq(7, [3] * 20, 4)
    seq.block_table = [0, 1, 2]
    with pytest.raises(ConfigError, match="max_num_tokens"):
        runner.step(ScheduledBatch(0, (ScheduledSequence(seq, 0, 20, True),)))
    with pytest.raises(RequestError, match="request 7: block table of 3 blocks"):
        runner.step(ScheduledBatch(0, (ScheduledSequence(seq, 0, 14, False),)))
    with pytest.raises(RequestError, match="request 7: scheduled tokens"):
        runner.step(ScheduledBatch(0, (ScheduledSequence(seq, 18, 3, True),)))
    bad = new_seq(8, [3, spec.vocab_size + 5], 1)
    bad.block_table = [4]
    with pytest.raises(RequestError, match="request 8: token id outside the vocabulary"):
        runner.step(ScheduledBatch(0, (ScheduledSequence(bad, 0, 2, True),)))
    w = dict(weights)
    w.pop("final_norm")
    with pytest.raises(EngineError, match="'final_norm' is missing"):
        make_runner(spec, w)


def test_workspace_views_at_the_planned_offsets(tiny):
    """One arena; each buffer a view at the offset the compiler's planner gives for the run's
    limits (the same function plan.json comes from)."""
    spec, weights, _ = tiny
    limits = make_limits(max_num_tokens=32, max_batch_size=4, max_seq_len=64, tokens_per_block=8)
    planned = plan_workspace(spec, limits)
    runner = make_runner(spec, weights, max_num_tokens=32, max_batch_size=4, max_seq_len=64)
    ws = runner.workspace
    assert ws.nbytes == arena_bytes(planned)
    for b in planned:
        assert ws[b.name].data_ptr() == ws.arena.data_ptr() + b.offset, b.name
        assert tuple(ws[b.name].shape) == b.shape, b.name
        assert ws[b.name].dtype == TORCH_DTYPES[b.dtype], b.name


def test_bfloat16_error_is_that_of_transformers_bfloat16(tiny, request):
    """A bf16 engine is as close to the fp32 model as transformers' own bf16 run is."""
    import transformers

    spec, _, model = tiny
    ckpt = request.getfixturevalue(f"tiny_{model.config.model_type}_dir")
    _, w16 = load_engine_weights(ckpt, "bfloat16")
    m16 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    seqs = [new_seq(0, prompts(1, [40], spec.vocab_size, seed=9)[0], 6)]
    res = drive(
        make_runner(spec, w16, dtype="bfloat16"), seqs, chunk=16, budget=64, record_logits=True
    )
    full = seqs[0].all_token_ids
    ref32 = hf_logits(model, full)
    ref16 = hf_logits(m16, full).float()
    ours = max((row - ref32[pos]).abs().max().item() for (_, pos), row in res.logits.items())
    theirs = max((ref16[pos] - ref32[pos]).abs().max().item() for _, pos in res.logits)
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_step_without_sampled_rows_returns_no_tokens(tiny):
    spec, weights, _ = tiny
    runner = make_runner(spec, weights)
    seq = new_seq(0, prompts(1, [20], spec.vocab_size)[0], 2)
    BlockAllocator(200, 8).ensure(seq, 20)
    out = runner.step(ScheduledBatch(0, (ScheduledSequence(seq, 0, 12, False),)))
    assert out.token_ids == [] and out.logprobs is None
    assert runner.step(ScheduledBatch(1, ())).token_ids == []


@pytest.mark.cuda
def test_torch_backend_on_cuda_matches_cpu(tiny):
    """The same runner on CUDA (pinned staging, one H2D and one D2H copy per step)."""
    from llmc.cuda.torch_backend import TorchBackend

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec, weights, _ = tiny
    ps = prompts(4, LENGTHS, spec.vocab_size, seed=10)
    outs = []
    for dev in ("cpu", "cuda"):
        runner = make_runner(
            spec, weights, backend=TorchBackend(dev), device=dev, max_num_tokens=32
        )
        seqs = [
            new_seq(i, p, 12, **({"temperature": 0.8, "seed": 5} if i % 2 else {}))
            for i, p in enumerate(ps)
        ]
        outs.append(drive(runner, seqs, chunk=16, budget=32, start_every=2).outputs)
    assert outs[0] == outs[1]


def test_runner_from_an_engine_memory_plan(tiny):
    """The plan.json of a build (compiler's planner, round-tripped through JSON) drives it."""
    from llmc.compiler.memory_plan import MemoryPlan, plan_memory

    spec, weights, model = tiny
    limits = dict(max_batch_size=4, max_num_tokens=32, max_seq_len=64, tokens_per_block=8)
    plan = MemoryPlan.from_json(plan_memory(spec, make_limits(**limits)).to_json())
    runner = make_runner(spec, weights, workspace=plan.buffers, **limits)
    assert runner.workspace.nbytes == plan.workspace_bytes
    seqs = [new_seq(i, p, 3) for i, p in enumerate(prompts(3, [20, 9, 30], spec.vocab_size, 8))]
    res = drive(runner, seqs, chunk=16, budget=32, record_logits=True)
    _check_logits(model, seqs, res)
