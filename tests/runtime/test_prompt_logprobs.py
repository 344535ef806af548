"""``SamplingParams.prompt_logprobs`` (vLLM's): every prompt token's logprob given its prefix,
its rank and the top-k, against a float32 log_softmax of transformers' full-sequence logits
of the same tiny checkpoint; with and without chunked prefill (down to one-token steps), with
lm_head slices of two rows, under preemption, beside prefix reuse, mixed in a batch with
requests that do not ask; and the validation of the field."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.runner import hf_logits, load_hf
from llmc.base.errors import RequestError
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.prompt_logprobs import PromptLogprob
from llmc.runtime.types import MAX_LOGPROBS, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = dict(max_seq_len=96, max_batch_size=8, max_num_tokens=128, tokens_per_block=8)
LENGTHS = (1, 2, 11, 25, 40, 17)
TOPS = (3, 0, 20, None, 2, 5)  # per prompt: None = not asked
TOL = 1e-4


@pytest.fixture(scope="module")
def case(tiny_engine, tiny_llama_dir):
    """(engine dir, prompts, float32 log_softmax [len, V] of transformers' logits per prompt)."""
    engine = tiny_engine(tiny_llama_dir, **LIMITS)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]
    model = load_hf(tiny_llama_dir)
    ref = [torch.log_softmax(hf_logits(model, p).float(), dim=-1) for p in prompts]
    return engine, prompts, ref


def params(k: int | None, new: int = 2) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, ignore_eos=True, prompt_logprobs=k)


def run(engine, prompts, config: RuntimeConfig, tops=TOPS, new: int = 2):
    rt = EngineRuntime.load(engine, config)
    ex = rt.executor()
    outs = ex.generate(prompts, [params(k, new) for k in tops])
    stats = ex.kv_stats()
    assert stats.free_blocks == stats.total_blocks
    return outs, ex, rt


def assert_entry(e: PromptLogprob, token: int, row: torch.Tensor, k: int) -> None:
    """One entry against the reference log_softmax ``row`` of the token's prefix."""
    assert isinstance(e, PromptLogprob) and e.token_id == token
    want = row[token].item()
    assert abs(e.logprob - want) <= TOL, (e.logprob, want)
    # rank as vLLM counts it (entries >= the token's logprob), up to reference rounding
    assert int((row > want + TOL).sum()) + 1 <= e.rank <= int((row >= want - TOL).sum())
    assert len(e.top) == k
    values = list(e.top.values())
    torch.testing.assert_close(torch.tensor(values), row.topk(k).values, atol=TOL, rtol=0)
    for tid, v in e.top.items():  # ids: each one's reference logprob is its value
        assert abs(row[tid].item() - v) <= TOL
    assert values == sorted(values, reverse=True)


def assert_prompt_logprobs(outs, prompts, ref, tops=TOPS) -> None:
    for o, p, lp, k in zip(outs, prompts, ref, tops, strict=True):
        assert o.ok, o.error
        if k is None:
            assert o.prompt_logprobs is None
            continue
        assert len(o.prompt_logprobs) == len(p) == len(o.prompt_token_ids)
        assert o.prompt_logprobs[0] is None  # no prefix to predict the first token from
        for i in range(1, len(p)):
            assert_entry(o.prompt_logprobs[i], p[i], lp[i - 1], k)


@pytest.mark.parametrize(
    "config",
    [
        RuntimeConfig(),  # every prompt in one step
        RuntimeConfig(max_num_tokens=12),  # chunked prefill, mixed with decode rows
        RuntimeConfig(max_num_tokens=1),  # one-token chunks (the decode-shaped step path)
        RuntimeConfig(max_batch_size=2),  # logits workspace of 2 rows: lm_head in slices
    ],
    ids=["whole", "chunked", "one_token_steps", "two_row_slices"],
)
def test_prompt_logprobs_equal_transformers(case, config):
    engine, prompts, ref = case
    outs, ex, _ = run(engine, prompts, config)
    assert_prompt_logprobs(outs, prompts, ref)
    budget = config.max_num_tokens
    if budget is not None:
        assert all(s.num_tokens <= budget for s in ex.step_records)
    if budget == 12:
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in ex.step_records)


def test_lm_head_runs_in_slices_of_the_logits_workspace(case):
    """No [max_num_tokens, vocab] buffer: every lm_head call writes at most the planned
    logits workspace's rows (max_batch_size), inside that workspace."""
    engine, prompts, ref = case
    rt = EngineRuntime.load(engine, RuntimeConfig(max_batch_size=3))
    logits_ws = rt.runner.workspace["logits"]
    assert logits_ws.shape[0] == 3
    lm_head = rt.runner.weights["lm_head"]
    backend = rt.runner.backend
    real = backend.linear
    rows: list[int] = []

    def linear(x, weight, bias=None, out=None):
        if weight is lm_head:
            assert out is not None and out.data_ptr() == logits_ws.data_ptr()
            rows.append(x.shape[0])
        return real(x, weight, bias, out=out)

    backend.linear = linear
    outs = rt.executor().generate(prompts[4:5], params(1, new=1))
    assert_prompt_logprobs(outs, prompts[4:5], ref[4:5], (1,))
    assert max(rows) == 3 and sum(rows) >= len(prompts[4]) - 1  # 39 scored rows, 3 at a time


def test_prompt_logprobs_under_preemption(case):
    engine, prompts, ref = case
    config = RuntimeConfig(
        scheduler_policy="max_utilization", max_kv_tokens=96, enable_block_reuse=False
    )
    outs, ex, _ = run(engine, prompts, config, new=20)
    assert sum(s.num_preempted for s in ex.step_records) > 0
    assert_prompt_logprobs(outs, prompts, ref)


def test_prompt_logprobs_requests_share_no_cached_prefix(case):
    """A request asking for prompt logprobs computes every position, even when its prefix
    blocks are cached; the others still reuse them."""
    engine, prompts, ref = case
    rt = EngineRuntime.load(engine, RuntimeConfig(enable_block_reuse=True))
    ex = rt.executor()
    p, lp = prompts[4], ref[4]
    [first] = ex.generate([p], params(None))
    [again] = ex.generate([p], params(None))
    [scored] = ex.generate([p], params(2))
    assert first.record.num_cached_tokens == 0 and again.record.num_cached_tokens > 0
    assert scored.record.num_cached_tokens == 0
    assert_prompt_logprobs([scored], [p], [lp], (2,))
    assert scored.token_ids == again.token_ids == first.token_ids


def test_streaming_request_gets_them_on_its_final_response(case):
    from llmc.runtime.types import Request

    engine, prompts, ref = case
    ex = EngineRuntime.load(engine, RuntimeConfig()).executor()
    rid = ex.enqueue_request(
        Request(prompt_token_ids=prompts[2], sampling=params(1, 4), streaming=True)
    )
    responses = []
    while not responses or not responses[-1].is_final:
        responses += ex.await_responses(rid)
    assert all(r.prompt_logprobs is None for r in responses[:-1])
    final = responses[-1].prompt_logprobs
    assert len(final) == len(prompts[2]) and final[0] is None
    for i in range(1, len(prompts[2])):
        assert_entry(final[i], prompts[2][i], ref[2][i - 1], 1)


@pytest.mark.parametrize("value", [-1, 1.5, True, "3", [2]])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(RequestError, match=r"sampling parameter prompt_logprobs=") as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.exit_code == 8


def test_prompt_logprobs_above_the_engine_limit_name_both_numbers():
    with pytest.raises(RequestError) as err:
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
    message = str(err.value)
    assert "prompt_logprobs=21" in message and "limit of 20" in message
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
