"""End to end against transformers: greedy token ids of the Executor equal HF ``generate``
(do_sample=False) for tiny random Llama / Qwen2 engines built by ``llmc build`` and for the
real SmolLM2, in a batch of mixed-length prompts; also with chunked prefill, with prefix
reuse on and off, and under forced preemption. Log-probabilities agree with HF's logits
within fp32 tolerance. Seeded sampling gives the same tokens alone and inside a batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers.engines import make_limits
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 36
TINY_LIMITS = dict(max_seq_len=96, max_batch_size=8, max_num_tokens=128, tokens_per_block=8)


def hf_reference(
    model_dir: Path, prompts: list[list[int]], n: int, batched: bool = False
) -> list[tuple[list, torch.Tensor]]:
    """(greedy token ids, per-step log_softmax [n, V]) of transformers' ``generate``, EOS
    disabled so that exactly ``n`` tokens are generated. One prompt at a time (no padding),
    or ``batched``: one left-padded batch (what a 135M model on a 2-core CPU can afford)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    out = []
    with torch.no_grad():
        if batched:
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            r = model.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
            logprobs = torch.log_softmax(torch.stack(r.logits, dim=1).float(), dim=-1)
            return [(r.sequences[i, width:].tolist(), logprobs[i]) for i in range(len(prompts))]
        for p in prompts:
            r = model.generate(torch.tensor([p]), pad_token_id=0, **kw)
            logprobs = torch.log_softmax(torch.cat(r.logits).float(), dim=-1)
            out.append((r.sequences[0, len(p) :].tolist(), logprobs))
    return out


def mixed_prompts(vocab: int, lengths=(3, 11, 25, 40), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_engine):
    """(engine dir, prompts, HF reference) of one tiny architecture."""
    ckpt = request.getfixturevalue(f"tiny_{request.param}_dir")
    out = tiny_engine(ckpt, **TINY_LIMITS)
    prompts = mixed_prompts(256)
    # two prompts that share a 2-block prefix with the first, to exercise prefix reuse
    prompts += [prompts[3][:16] + [7, 8, 9], prompts[3][:24] + [10]]
    return out, prompts, hf_reference(ckpt, prompts, NEW_TOKENS)


def run_greedy(engine_dir: Path, prompts, config: RuntimeConfig, logprobs=None, repeat=1):
    rt = EngineRuntime.load(engine_dir, config)
    ex = rt.executor()
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    outs = []
    for _ in range(repeat):
        outs = ex.generate(prompts, sp)
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks
    rt.kv.check_invariants()
    return outs, ex


def assert_same_tokens(outs, ref) -> None:
    for i, (o, (ids, _)) in enumerate(zip(outs, ref, strict=True)):
        assert o.ok, o.error
        assert o.token_ids == ids, f"prompt {i}: first difference at token " + str(
            next(k for k, (a, b) in enumerate(zip(o.token_ids, ids, strict=False)) if a != b)
        )


def test_greedy_equals_hf_and_logprobs_agree(tiny):
    engine_dir, prompts, ref = tiny
    outs, ex = run_greedy(engine_dir, prompts, RuntimeConfig(), logprobs=3)
    assert_same_tokens(outs, ref)
    for o, (ids, lp) in zip(outs, ref, strict=True):
        ours = torch.tensor([t.logprob for t in o.logprobs])
        torch.testing.assert_close(ours, lp[torch.arange(len(ids)), ids], atol=2e-4, rtol=0)
        top = torch.tensor([[v for _, v in t.top] for t in o.logprobs])
        torch.testing.assert_close(top, lp.topk(3, dim=-1).values, atol=2e-4, rtol=0)
    assert max(s.batch_size for s in ex.step_records) == len(prompts)  # really batched


@pytest.mark.parametrize("extra", [1, 16, 64])
def test_greedy_equals_hf_with_chunked_prefill(tiny, extra):
    engine_dir, prompts, ref = tiny
    budget = len(prompts) + extra  # decode load + this many prefill tokens per step
    outs, ex = run_greedy(engine_dir, prompts, RuntimeConfig(max_num_tokens=budget))
    assert_same_tokens(outs, ref)
    steps = ex.step_records
    assert all(s.num_tokens <= budget for s in steps)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # mixed steps


@pytest.mark.parametrize("reuse", [True, False])
def test_greedy_equals_hf_with_prefix_reuse_on_and_off(tiny, reuse):
    engine_dir, prompts, ref = tiny
    config = RuntimeConfig(enable_block_reuse=reuse, max_num_tokens=24)
    outs, ex = run_greedy(engine_dir, prompts, config, repeat=2)
    assert_same_tokens(outs, ref)
    hits = ex.kv_stats().reuse_hits
    assert (hits > 0) == reuse
    cached = sum(o.record.num_cached_tokens for o in outs)
    assert (cached > 0) == reuse


def test_greedy_equals_hf_under_forced_preemption(tiny):
    engine_dir, prompts, ref = tiny
    config = RuntimeConfig(
        scheduler_policy="max_utilization", max_kv_tokens=96, enable_block_reuse=False
    )
    outs, ex = run_greedy(engine_dir, prompts, config)
    assert_same_tokens(outs, ref)
    assert sum(s.num_preempted for s in ex.step_records) > 0
    assert sum(o.record.num_preemptions for o in outs) > 0


def test_greedy_equals_hf_with_a_one_token_step_budget(tiny):
    engine_dir, prompts, ref = tiny
    outs, ex = run_greedy(engine_dir, prompts[:2], RuntimeConfig(max_num_tokens=1))
    assert_same_tokens(outs, ref[:2])
    assert {s.num_tokens for s in ex.step_records} == {1}


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "cuda"])
def test_greedy_equals_hf_on_cuda(tiny_engine, tiny_llama_dir, backend):
    out = tiny_engine(tiny_llama_dir, target="auto", **TINY_LIMITS)
    prompts = mixed_prompts(256)
    ref = hf_reference(tiny_llama_dir, prompts, NEW_TOKENS)
    config = RuntimeConfig(device="cuda", backend=backend, max_num_tokens=len(prompts) + 16)
    outs, ex = run_greedy(out, prompts, config)
    assert ex.engine.backend == backend and ex.engine.device == "cuda"
    assert_same_tokens(outs, ref)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny):
    engine_dir, prompts, _ = tiny
    rt = EngineRuntime.load(engine_dir, RuntimeConfig())
    sp = SamplingParams(
        max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True
    )
    ex = rt.executor()
    [alone] = ex.generate([prompts[1]], sp)
    others = [SamplingParams(20, temperature=1.3, seed=s, ignore_eos=True) for s in range(4)]
    batch = ex.generate(
        [prompts[0], prompts[2], prompts[1], prompts[3], prompts[1]],
        [others[0], others[1], sp, others[2], others[3]],
    )
    assert batch[2].token_ids == alone.token_ids
    assert batch[4].token_ids != alone.token_ids  # another seed, another sample
    greedy = ex.generate([prompts[1]], SamplingParams(24, ignore_eos=True))[0]
    assert alone.token_ids != greedy.token_ids  # it did sample


# ---- the real model ---------------------------------------------------------------------
SMOL_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def test_smollm2_greedy_equals_hf(smollm2_hf_dir):
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.compiler.weight_passes import to_engine_weights

    tok = Tokenizer.from_dir(smollm2_hf_dir)
    prompts = [list(tok.apply_chat_template(p)) for p in SMOL_PROMPTS]
    prompts.append(tok.encode("The quick brown fox"))
    ref = hf_reference(smollm2_hf_dir, prompts, 32, batched=True)
    ckpt = load_checkpoint(str(smollm2_hf_dir))
    spec, weights = ckpt.spec, to_engine_weights(ckpt.spec, ckpt.tensors, "float32")
    del ckpt
    limits = make_limits(max_batch_size=4, max_seq_len=128, max_num_tokens=48, tokens_per_block=16)
    rt = EngineRuntime.from_weights(spec, weights, limits=limits, num_kv_blocks=32, tokenizer=tok)
    ex = rt.executor()
    outs = ex.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=0))
    assert_same_tokens(outs, ref)
    for o, (ids, lp) in zip(outs, ref, strict=True):  # 30 fp32 layers: logits agree closely
        ours = torch.tensor([t.logprob for t in o.logprobs])
        torch.testing.assert_close(ours, lp[torch.arange(len(ids)), ids], atol=1e-3, rtol=0)
    assert "Paris" in outs[0].text
    assert ex.kv_stats().free_blocks == 32
