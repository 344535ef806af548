"""Several outputs through the front door (llmc/api.py): the vLLM-style script of issue 16
(``SamplingParams(max_tokens=16, n=2, logprobs=2)`` → ``out[0].outputs[1].text``), best_of,
and vLLM's ``BeamSearchParams`` / ``LLM.beam_search`` as aliases of the beam-search
``SamplingParams``; the KV pool is free after each."""

from __future__ import annotations

import pytest

from llmc import LLM, BeamSearchParams, SamplingParams
from llmc.base.errors import ConfigError, RequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = dict(max_batch_size=8, max_seq_len=64, max_num_tokens=64, tokens_per_block=8,
              max_beam_width=4)  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_engine, tiny_llama_dir):
    with LLM(model=tiny_engine(tiny_llama_dir, **LIMITS), device="cpu") as model:
        yield model


def _pool_free(llm: LLM) -> bool:
    stats = llm.kv_stats()
    return stats.free_blocks == stats.total_blocks


def test_the_vllm_script_with_n_and_logprobs_runs_unchanged(llm):
    prompts = ["Hello, my name is", "The capital of France is"]
    out = llm.generate(prompts, SamplingParams(max_tokens=16, n=2, logprobs=2, temperature=0.8,
                                               seed=7, ignore_eos=True))  # fmt: skip
    assert [len(o.outputs) for o in out] == [2, 2]
    second = out[0].outputs[1]
    assert isinstance(second.text, str) and second.index == 1 and len(second.token_ids) == 16
    assert len(second.logprobs) == 16
    for token, entry in zip(second.token_ids, second.logprobs, strict=True):
        assert token in entry and all(lp.decoded_token is not None for lp in entry.values())
        assert len(entry) >= 2
    assert second.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(second.token_ids, second.logprobs, strict=True))
    )
    assert out[0].outputs[0].token_ids == out[0].token_ids
    assert out[0].outputs[0].token_ids != second.token_ids  # two seed streams
    assert _pool_free(llm)


def test_best_of_returns_n_outputs_best_first(llm):
    [out] = llm.generate(["abc"], SamplingParams(max_tokens=8, n=2, best_of=5, temperature=1.0,
                                                 seed=2, ignore_eos=True))  # fmt: skip
    cums = [c.cumulative_logprob for c in out.outputs]
    assert len(cums) == 2 and cums == sorted(cums, reverse=True)
    assert _pool_free(llm)


def test_beam_search_alias_equals_the_sampling_params_form(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.7)
    [alias] = llm.beam_search(["hello"], params)
    same = SamplingParams(max_tokens=8, use_beam_search=True, beam_width=3, n=3,
                          length_penalty=0.7)  # fmt: skip
    [direct] = llm.generate(["hello"], same)
    assert [c.token_ids for c in alias.outputs] == [c.token_ids for c in direct.outputs]
    assert len(alias.outputs) == 3 and alias.outputs[0].cumulative_logprob is not None
    assert _pool_free(llm)


def test_bad_beam_search_params_are_refused():
    with pytest.raises(RequestError, match="temperature=0.5: beam search is greedy"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    with pytest.raises(ValueError, match="beam_width=0"):  # RequestError is a ValueError
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_beam_search_takes_beam_search_params(llm):
    with pytest.raises(ConfigError, match="takes a BeamSearchParams"):
        llm.beam_search(["hello"], SamplingParams())  # type: ignore[arg-type]
