"""Beam search and n / best_of samples end to end against transformers on the tiny Llama and
Qwen2 engines (float32, ``llmc build --max_beam_width 4``): beams with k = 2 and 4 give the
sequences and scores of ``generate(num_beams=k, do_sample=False, length_penalty=...,
early_stopping=..., num_return_sequences=k)`` (``sequences_scores``), alone and in a batch
mixed with greedy and sampled requests, with chunked prefill and under preemption, a stop id
included; seeded samples are the same alone and in a batch; the KV pool is free after."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import FinishReason, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = dict(
    max_seq_len=96, max_batch_size=16, max_num_tokens=128, tokens_per_block=8, max_beam_width=4
)
NEW = 10
EOS = 2  # the tiny checkpoints' eos_token_id (the engine's too)
PAD = 1  # transformers fills a finished beam with it (a pad id of 0 would read as "none")


def prompts_of(lengths=(3, 11, 25), seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_engine):
    """(checkpoint, engine dir, transformers model) of one tiny architecture."""
    import transformers

    ckpt = request.getfixturevalue(f"tiny_{request.param}_dir")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return ckpt, tiny_engine(ckpt, **LIMITS), model


def hf_beams(model, prompt, k, penalty, early, eos=(EOS,), new=NEW):
    """[(token ids, score)] of transformers' beam search, best first."""
    with torch.no_grad():
        r = model.generate(
            torch.tensor([prompt]),
            num_beams=k,
            do_sample=False,
            length_penalty=penalty,
            early_stopping=early,
            num_return_sequences=k,
            output_scores=True,
            return_dict_in_generate=True,
            max_new_tokens=new,
            eos_token_id=list(eos),
            pad_token_id=PAD,
        )
    return [
        (r.sequences[i, len(prompt) :].tolist(), float(r.sequences_scores[i])) for i in range(k)
    ]


def assert_same_beams(completions, ref, penalty) -> None:
    assert len(completions) == len(ref)
    for c, (ids, score) in zip(completions, ref, strict=True):
        assert c.token_ids == ids[: len(c.token_ids)]
        assert all(t == PAD for t in ids[len(c.token_ids) :]), (c.token_ids, ids)  # HF's fill
        ours = c.cumulative_logprob / len(c.token_ids) ** penalty
        assert ours == pytest.approx(score, abs=1e-4)


def beam_params(k, penalty, early, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("new", NEW), use_beam_search=True, beam_width=k,
                          n=k, length_penalty=penalty, early_stopping=early, **kw)  # fmt: skip


def run(engine_dir: Path, prompts, params, config: RuntimeConfig | None = None):
    rt = EngineRuntime.load(engine_dir, config or RuntimeConfig())
    ex = rt.executor()
    outs = ex.generate(prompts, params)
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks
    rt.kv.check_invariants()
    for o in outs:
        assert o.ok, o.error
    return outs, ex


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("penalty, early", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beams_equal_transformers(tiny, k, penalty, early):
    _, engine_dir, model = tiny
    prompts = prompts_of()
    outs, ex = run(engine_dir, prompts, beam_params(k, penalty, early))
    for o, p in zip(outs, prompts, strict=True):
        assert_same_beams(o.completions, hf_beams(model, p, k, penalty, early), penalty)
        assert o.token_ids == o.completions[0].token_ids
    assert max(s.batch_size for s in ex.step_records) == len(prompts) * k  # beams are rows


def test_beams_alone_with_a_stop_id_and_returning_fewer(tiny):
    _, engine_dir, model = tiny
    p = prompts_of()[1]
    plain = hf_beams(model, p, 4, 1.0, False)
    stop = plain[0][0][0]  # the best beam's first token: it now ends beams
    # no length penalty: the one-token beam that ends on it scores best and is returned
    ref = hf_beams(model, p, 4, 0.0, False, eos=(EOS, stop))
    [out], _ = run(engine_dir, [p], beam_params(4, 0.0, False, stop_token_ids=[stop]))
    assert_same_beams(out.completions, ref, 0.0)
    assert any(c.finish_reason is FinishReason.STOP for c in out.completions)
    for c in out.completions:
        assert (c.finish_reason is FinishReason.STOP) == (c.token_ids[-1] == stop)
    [two], _ = run(engine_dir, [p], SamplingParams(max_new_tokens=NEW, use_beam_search=True,
                                                     beam_width=4, n=2))  # fmt: skip
    assert [c.token_ids for c in two.completions] == [c for c, _ in plain[:2]]


def test_logit_bias_steers_the_beams(tiny):
    """logit_bias is added to the logits before the beams are scored (OpenAI's and vLLM's
    rule; transformers' ``sequence_bias`` adds to the log-probs, so its scores differ)."""
    _, engine_dir, model = tiny
    p = prompts_of()[1]
    [forced], _ = run(engine_dir, [p], beam_params(2, 1.0, False, new=4, logit_bias={7: 100.0}))
    assert forced.completions[0].token_ids == [7, 7, 7, 7]
    first = hf_beams(model, p, 2, 1.0, False)[0][0][0]  # the unbiased best beam's first token
    [banned], _ = run(engine_dir, [p], beam_params(2, 1.0, False, logit_bias={first: -100.0}))
    assert all(first not in c.token_ids for c in banned.completions)


def test_beams_in_a_batch_with_greedy_and_sampled_requests(tiny):
    _, engine_dir, model = tiny
    prompts = prompts_of()
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=11, ignore_eos=True)
    [alone], _ = run(engine_dir, [prompts[0]], seeded)
    mixed = [prompts[0], prompts[1], prompts[2], prompts[1]]
    params = [seeded, beam_params(4, 1.0, False), greedy, beam_params(2, 0.5, True)]
    outs, ex = run(engine_dir, mixed, params)
    assert outs[0].token_ids == alone.token_ids
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompts[2]]), do_sample=False, max_new_tokens=NEW,
                            eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert outs[2].token_ids == hf[0, len(prompts[2]) :].tolist()
    assert_same_beams(outs[1].completions, hf_beams(model, prompts[1], 4, 1.0, False), 1.0)
    assert_same_beams(outs[3].completions, hf_beams(model, prompts[1], 2, 0.5, True), 0.5)


@pytest.mark.parametrize("budget", [9, 20])
def test_beams_with_chunked_prefill(tiny, budget):
    _, engine_dir, model = tiny
    prompts = prompts_of()
    outs, ex = run(
        engine_dir, prompts, beam_params(4, 1.0, False), RuntimeConfig(max_num_tokens=budget)
    )
    assert all(s.num_tokens <= budget for s in ex.step_records)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in ex.step_records)
    for o, p in zip(outs, prompts, strict=True):
        assert_same_beams(o.completions, hf_beams(model, p, 4, 1.0, False), 1.0)


def test_beams_under_preemption(tiny):
    _, engine_dir, model = tiny
    long = prompts_of((40, 40, 40), seed=8)  # greedy requests that fill the pool first
    prompts = prompts_of((11, 25, 20))
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    # the smallest pool the load accepts: one request's 4 beams of max_seq_len tokens
    config = RuntimeConfig(scheduler_policy="max_utilization", max_kv_tokens=4 * 96,
                           enable_block_reuse=False)  # fmt: skip
    params = [greedy] * 3 + [beam_params(4, 1.0, "never", new=40)] * 3
    outs, ex = run(engine_dir, long + prompts, params, config)
    assert sum(o.record.num_preemptions for o in outs[3:]) > 0  # beam groups were preempted
    for o, p in zip(outs[3:], prompts, strict=True):
        assert_same_beams(o.completions, hf_beams(model, p, 4, 1.0, "never", new=40), 1.0)
    with torch.no_grad():
        for o, p in zip(outs[:3], long, strict=True):
            hf = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40,
                                eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert o.token_ids == hf[0, len(p) :].tolist()


def test_more_beams_than_built_for_are_refused(tiny):
    _, engine_dir, _ = tiny
    rt = EngineRuntime.load(engine_dir, RuntimeConfig())
    [out] = rt.executor().generate([prompts_of()[0]], beam_params(5, 1.0, False))
    assert out.error and "beam_width=5" in out.error and "max_beam_width=4" in out.error


def test_seeded_n_samples_are_the_same_alone_and_in_a_batch(tiny):
    _, engine_dir, _ = tiny
    prompts = prompts_of()
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=50, seed=1234, n=4,
                        ignore_eos=True)  # fmt: skip
    [alone], ex = run(engine_dir, [prompts[1]], sp)
    samples = [c.token_ids for c in alone.completions]
    assert len(set(map(tuple, samples))) == 4
    # sample 0 draws from the request's own seed: it is the n=1 request's output
    one_sp = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=50, seed=1234,
                            ignore_eos=True)  # fmt: skip
    [one], _ = run(engine_dir, [prompts[1]], one_sp)
    assert samples[0] == one.token_ids
    other = SamplingParams(max_new_tokens=NEW, temperature=1.1, seed=5, n=2, ignore_eos=True)
    batch, ex = run(engine_dir, [prompts[0], prompts[1], prompts[2]], [other, sp, other])
    assert [c.token_ids for c in batch[1].completions] == samples
    prefill = sum(s.num_prefill_tokens for s in ex.step_records)
    assert prefill == sum(map(len, prompts))  # each prompt prefilled once, however many samples


def test_best_of_keeps_the_samples_of_highest_cumulative_logprob(tiny):
    _, engine_dir, _ = tiny
    p = prompts_of()[2]
    base = dict(max_new_tokens=NEW, temperature=1.0, seed=99, ignore_eos=True)
    [every], _ = run(engine_dir, [p], SamplingParams(n=4, logprobs=0, **base))
    [best], _ = run(engine_dir, [p], SamplingParams(n=2, best_of=4, **base))
    ranked = sorted(every.completions, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.completions] == [c.token_ids for c in ranked]
    for b, r in zip(best.completions, ranked, strict=True):
        assert b.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
        assert r.cumulative_logprob == pytest.approx(sum(t.logprob for t in r.logprobs))


def test_a_stop_string_ends_only_the_sample_that_shows_it(tiny):
    _, engine_dir, _ = tiny
    p = prompts_of()[2]
    base = dict(max_new_tokens=24, temperature=1.0, seed=21, n=4, ignore_eos=True)
    [free], _ = run(engine_dir, [p], SamplingParams(**base))
    texts = [c.text for c in free.completions]
    stop = next(ch for ch in texts[1][2:] if ch.isascii() and ch.isalnum())
    [cut], _ = run(engine_dir, [p], SamplingParams(stop=stop, **base))
    for full, c in zip(texts, cut.completions, strict=True):
        if stop in full:
            assert c.text == full[: full.index(stop)] and c.finish_reason is FinishReason.STOP
        else:
            assert c.text == full and c.finish_reason is FinishReason.LENGTH
