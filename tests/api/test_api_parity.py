"""The LLM API shape users port from vLLM and TensorRT-LLM (llmc/api.py, llmc/api_inputs.py,
runtime/responses.py, runtime/logprobs.py): ``LLM(model=PATH)`` for an engine, an HF checkpoint
and a GGUF file; ``SamplingParams(max_tokens=...)``; ``RequestOutput.outputs`` / ``metrics``;
token-id prompts; chat conversations refused as prompts; errors that are ``ValueError``s;
``logprobs`` / ``prompt_logprobs`` with texts against transformers' log_softmax (tiny Llama and
Qwen2); ``min_tokens`` against transformers' ``min_new_tokens``; ``logit_bias`` against
transformers' ``sequence_bias``; ``LLM.chat`` against transformers' ``apply_chat_template``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

import pytest
import torch

from helpers.engines import tiny_build_config
from helpers.gguf_files import write_gguf
from helpers.runner import hf_logits, load_hf
from llmc import LLM, Request, SamplingParams
from llmc.base.errors import ConfigError, EngineError, RequestError
from llmc.runtime.logprobs import Logprob, PromptLogprob, TokenLogprobs
from llmc.runtime.responses import CompletionOutput, RequestMetrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = dict(max_batch_size=4, max_seq_len=128, max_num_tokens=64, tokens_per_block=16)
TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def served(request, tiny_engine):
    """(LLM over a tiny engine, its checkpoint dir) for Llama and Qwen2."""
    ckpt = request.getfixturevalue(request.param)
    with LLM(tiny_engine(ckpt, **LIMITS), device="cpu") as llm:
        yield llm, ckpt


@pytest.fixture(scope="module")
def llm(tiny_engine, tiny_llama_dir):
    with LLM(model=tiny_engine(tiny_llama_dir, **LIMITS), device="cpu") as model:
        yield model


# ---- SamplingParams ----------------------------------------------------------------------
def test_max_tokens_is_max_new_tokens():
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams().max_new_tokens == SamplingParams().max_tokens == 32
    assert SamplingParams(max_new_tokens=5, max_tokens=5).max_new_tokens == 5
    with pytest.raises(RequestError, match="max_new_tokens=32 and max_tokens=16 differ"):
        SamplingParams(max_new_tokens=32, max_tokens=16)
    with pytest.raises(RequestError, match="max_tokens=0: must be an integer in"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="min_tokens=9: more than max_new_tokens=8"):
        SamplingParams(max_tokens=8, min_tokens=9)
    with pytest.raises(RequestError, match="min_tokens=-1"):
        SamplingParams(min_tokens=-1)
    assert not SamplingParams(min_tokens=2).is_plain and SamplingParams().is_plain
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"


def test_request_and_config_errors_are_value_errors(tiny_engine, tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir, **LIMITS)
    with pytest.raises(ValueError, match="max_num_tokens=10000 exceeds"):
        LLM(engine, max_num_tokens=10_000)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


# ---- LLM(model=PATH) ----------------------------------------------------------------------
def test_model_path_is_an_engine_a_checkpoint_or_a_gguf(tiny_engine, tiny_llama_dir, tmp_path,
                                                        monkeypatch):  # fmt: skip
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    engine = tiny_engine(tiny_llama_dir, **LIMITS)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [1, 17, 42, 99]
    with LLM(model=engine, device="cpu") as a:
        assert a.engine_dir == engine
        want = a.generate(prompt, sp)[0].outputs[0].token_ids
    cfg = tiny_build_config(**LIMITS)
    with LLM(model=tiny_llama_dir, build_config=cfg, device="cpu") as b:  # built on the fly
        assert b.engine_dir.parent == tmp_path / "cache" / "engines"
        assert b.generate(prompt, sp)[0].outputs[0].token_ids == want
    gguf_path = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    with LLM(model=str(gguf_path), build_config=cfg, device="cpu") as c:
        assert c.engine_dir.parent == tmp_path / "cache" / "engines"
        assert c.generate(prompt, sp)[0].outputs[0].token_ids == want  # same weights (F32)
    with pytest.raises(EngineError, match="does not exist.*downloads no models"):
        LLM(model="meta-llama/Llama-3-8B")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match="is a file but not a .gguf"):
        LLM(model=tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="model=.* and engine_dir both name"):
        LLM(model=engine, engine_dir=engine)
    with pytest.raises(ConfigError, match="pass one or the other"):
        LLM(model=engine, build_config=cfg)


def test_a_vllm_script_runs_unchanged(llm):
    from llmc import LLM as PublicLLM
    from llmc import SamplingParams as PublicParams

    assert PublicLLM is LLM and PublicParams is SamplingParams
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True))
    for output in outputs:
        prompt, generated = output.prompt, output.outputs[0].text
        assert prompt in prompts and isinstance(generated, str)
        c = output.outputs[0]
        assert isinstance(c, CompletionOutput) and c.index == 0 and len(c.token_ids) == 6
        assert c.finish_reason == "length" and c.finished() and output.finished
        assert c.text == output.text and c.token_ids == output.token_ids  # llmc's names too
        assert len(c.logprobs) == 6
        assert math.isclose(c.cumulative_logprob, sum(e.logprob for e in c.logprobs))
        for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert isinstance(entry[tid], Logprob) and entry[tid].rank == 1  # greedy
            assert entry[tid].decoded_token == llm.tokenizer.token_text(tid)
            assert 2 <= len(entry) <= 3
        m = output.metrics
        assert isinstance(m, RequestMetrics) and m.time_in_queue >= 0
        assert m.num_cached_tokens == output.num_cached_tokens == output.timings.num_cached_tokens
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert output.prompt_token_ids == llm.tokenizer.encode(prompt)


def test_token_id_prompts_one_or_several(llm):
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    (one,) = llm.generate([5, 6, 7], sp)
    two = llm.generate([[5, 6, 7], [8, 9]], sp)
    assert [o.prompt_token_ids for o in two] == [[5, 6, 7], [8, 9]]
    assert two[0].outputs[0].token_ids == one.outputs[0].token_ids and one.prompt is None
    (as_dict,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)  # vLLM's
    assert as_dict.token_ids == one.token_ids
    texts = llm.generate([{"prompt": "hello"}, "hello"], sp)
    assert texts[0].token_ids == texts[1].token_ids and texts[0].prompt == "hello"
    with pytest.raises(RequestError, match="exactly one of the keys prompt, prompt_token_ids"):
        llm.generate({"text": "hello"})


def test_chat_messages_as_a_prompt_say_what_was_passed(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(RequestError, match="a list of 2 chat messages .* LLM.chat"):
        llm.generate(messages)
    with pytest.raises(RequestError, match="a list of 2 chat messages"):
        llm.generate([messages, messages])
    with pytest.raises(RequestError, match="one chat message \\(a dict with a role\\)"):
        llm.generate(["text", {"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="prompt_token_ids is a list of 2 chat messages"):
        Request(prompt_token_ids=messages)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="'content' must be a string, got int"):
        llm.chat([{"role": "user", "content": 3}])
    with pytest.raises(RequestError, match="LLM.chat takes a conversation"):
        llm.chat("hello")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="'tokenize' is llmc's to set"):
        llm.chat(messages, chat_template_kwargs={"tokenize": False})


# ---- logprobs and prompt logprobs against transformers -----------------------------------
def test_logprobs_and_prompt_logprobs_equal_transformers(served):
    llm, ckpt = served
    prompt, k = [1, 17, 42, 99, 5, 230, 7], 3
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    (out,) = llm.generate(prompt, sp)
    assert out.ok, out.error
    ids = out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(load_hf(ckpt), prompt + ids).float(), dim=-1)
    tok = llm.tokenizer
    for j, (tid, e) in enumerate(zip(ids, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + j]
        assert isinstance(e, TokenLogprobs) and isinstance(e, Mapping) and e.token_id == tid
        assert abs(e[tid].logprob - row[tid].item()) <= TOL
        assert e[tid].rank == 1 and e[tid].decoded_token == tok.token_text(tid)  # greedy
        assert [i for i, _ in e.top] == row.topk(k).indices.tolist()
        for r, (i, v) in enumerate(e.top, 1):
            assert abs(v - row[i].item()) <= TOL and abs(e[i].logprob - v) == 0
            assert e[i].decoded_token == tok.token_text(i)
            assert i == tid or e[i].rank == r
    summed = sum(ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(ids))
    assert abs(out.outputs[0].cumulative_logprob - summed) <= 1e-3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, e in enumerate(out.prompt_logprobs[1:], 1):
        row, tid = ref[i - 1], prompt[i]
        assert isinstance(e, PromptLogprob) and abs(e[tid].logprob - row[tid].item()) <= TOL
        assert e[tid].rank == e.rank and e[tid].decoded_token == tok.token_text(tid)
        for r, i_top in enumerate(row.topk(k).indices.tolist(), 1):
            assert abs(e[i_top].logprob - row[i_top].item()) <= TOL
            assert e[i_top].decoded_token == tok.token_text(i_top)
            assert i_top == tid or e[i_top].rank == r


def test_streamed_logprobs_carry_texts(llm):
    async def collect():
        got = []
        sp = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
        async for r in llm.generate_async([4, 5, 6], sp):
            got.extend(r.logprobs or [])
        return got

    entries = asyncio.run(collect())
    assert len(entries) == 3
    assert all(e[e.token_id].decoded_token == llm.tokenizer.token_text(e.token_id) for e in entries)


# ---- min_tokens -------------------------------------------------------------------------
def test_min_tokens_suppresses_stop_ids_like_transformers_min_new_tokens(llm, tiny_llama_dir):
    prompt = [1, 17, 42, 99, 5]
    free = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    stop = free[0]
    (early,) = llm.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop]))
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    sp = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[stop], logprobs=0)
    (out,) = llm.generate(prompt, sp)
    with torch.no_grad():
        ref = load_hf(tiny_llama_dir).generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=3, do_sample=False,
            eos_token_id=stop, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
    assert out.token_ids == ref
    assert stop not in out.token_ids[:3] and len(out.token_ids) >= 3
    assert all(e.logprob > -math.inf for e in out.logprobs)
    assert llm.kv_stats().free_blocks == llm.kv_stats().total_blocks


# ---- logit_bias --------------------------------------------------------------------------
def test_logit_bias_matches_transformers_sequence_bias(llm, tiny_llama_dir):
    prompt = [1, 17, 42, 99, 5]
    free = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    # ban the free run's first token, lift two others: greedy follows the biased logits
    lift = [t for t in (7, 11, 13) if t != free[0]][:2]
    bias = {free[0]: -100.0, lift[0]: 2.5, lift[1]: 1.25}
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=bias, logprobs=0)
    assert not sp.is_plain and sp.logit_bias == tuple(sorted(bias.items()))
    (out,) = llm.generate(prompt, sp)
    with torch.no_grad():
        hf = load_hf(tiny_llama_dir).generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
            sequence_bias={(t,): b for t, b in bias.items()}, output_scores=True,
            return_dict_in_generate=True, eos_token_id=None,
        )  # fmt: skip
    assert out.token_ids == hf.sequences[0, len(prompt) :].tolist()
    assert out.token_ids[0] != free[0]
    for entry, scores, tok in zip(out.logprobs, hf.scores, out.token_ids, strict=True):
        want = torch.log_softmax(scores[0].double(), -1)[tok].item()  # of the biased logits
        assert entry[tok].logprob == pytest.approx(want, abs=TOL)


def test_logit_bias_reaches_sampled_forks(llm):
    force = {7: 100.0}  # +100 outweighs any logit of the tiny model: every token is 7
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, ignore_eos=True,
                        logit_bias=force)  # fmt: skip
    (out,) = llm.generate([1, 2, 3], sp)
    assert [o.token_ids for o in out.outputs] == [[7, 7, 7, 7]] * 2


def test_logit_bias_is_checked(llm):
    with pytest.raises(RequestError, match=r"bias 101 of token 3 is not in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(RequestError, match="key -1 is not a non-negative integer token id"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(RequestError, match="must map token ids to biases"):
        SamplingParams(logit_bias=[1, 2])
    with pytest.raises(RequestError, match="at most 1024"):
        SamplingParams(logit_bias={i: 1.0 for i in range(1025)})
    assert SamplingParams(logit_bias={"12": -1}).logit_bias == ((12, -1.0),)  # JSON's keys
    (out,) = llm.generate([1, 2, 3], SamplingParams(max_tokens=2, logit_bias={10**6: 1}))
    assert out.finish_reason == "error" and "logit_bias token id 1000000" in out.error
    assert "outside the vocabulary" in out.error


def test_scheduler_does_not_stop_before_min_tokens():
    from helpers.fakes import make_scheduler
    from llmc.runtime.types import Sequence

    sched = make_scheduler(16, eos=(2,), max_batch_size=2, max_num_tokens=32, max_seq_len=32,
                           tokens_per_block=4)  # fmt: skip
    sp = SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[9])
    seq = Sequence(0, [5, 6, 7], sp, sp.max_new_tokens, arrival_time=0.0)
    sched.add(seq)
    assert seq.suppressed_ids == (2, 9)
    for token in (2, 9, 2, 9):  # the runner masks them; the scheduler still guards
        sched.update(sched.schedule(), [token])
    assert seq.output_token_ids == [2, 9, 2, 9] and seq.finish_reason == "stop"
    assert seq.stop_token_id == 9


# ---- chat -------------------------------------------------------------------------------
def test_chat_gives_transformers_apply_chat_template_ids(served):
    from transformers import AutoTokenizer

    llm, ckpt = served
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    ref = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True
    )
    ref_ids = list(ref["input_ids"] if isinstance(ref, Mapping) else ref)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    (out,) = llm.chat(conversation, sp)
    assert out.ok and out.prompt_token_ids == ref_ids and out.prompt == conversation
    outs = llm.chat([conversation, conversation[:2]], sp, add_generation_prompt=False)
    short = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        conversation[:2], add_generation_prompt=False, tokenize=True
    )
    short_ids = list(short["input_ids"] if isinstance(short, Mapping) else short)
    assert outs[1].prompt_token_ids == short_ids and outs[0].prompt_token_ids != ref_ids


def test_chat_passes_tools_and_template_kwargs(llm, tmp_path):
    from llmc.runtime.tokenizer import Tokenizer

    tok = llm.tokenizer
    template = (
        "{% if tools %}[tools: {{ tools | map(attribute='name') | join(',') }}]{% endif %}"
        "{% if shout %}!{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    custom = Tokenizer(tok._tok, tok.config, template, tok.eos_token_ids)
    text = custom.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, tools=[{"name": "f"}], shout=True
    )
    assert text == "[tools: f]!x"
    with pytest.raises(RequestError, match="needs apply_chat_template=True"):
        Request(prompt="x", chat_template_kwargs={"a": 1})


def test_chat_kwargs_reach_the_template_through_the_engine(llm):
    conv = [{"role": "user", "content": "hi"}]
    a = llm.chat(conv, SamplingParams(max_tokens=1), add_generation_prompt=True)[0]
    b = llm.chat(conv, SamplingParams(max_tokens=1), add_generation_prompt=False)[0]
    tail = llm.tokenizer.encode("assistant: ", add_special_tokens=False)
    assert a.prompt_token_ids == b.prompt_token_ids + tail
