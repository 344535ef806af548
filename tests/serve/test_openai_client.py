"""`llmc serve` through the official `openai` client: completions, chat, streaming, n,
usage, logprobs and the model list, against a real server process on 127.0.0.1."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(shared_server):
    return openai.OpenAI(base_url=shared_server.base_url, api_key="unused", max_retries=0)


def test_models_lists_the_served_engine(client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "llmc"
    assert client.models.retrieve("tiny").id == "tiny"


def test_completion_has_text_finish_reason_and_usage(client, serve_engine) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8

    from llmc.api import LLM
    from llmc.runtime.types import SamplingParams

    with LLM(serve_engine, device="cpu") as llm:  # the same engine in-process: same text
        ref = llm.generate(PROMPT, SamplingParams(max_new_tokens=8))[0]
    assert choice.text == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_logit_bias_gives_the_in_process_text(client, serve_engine) -> None:
    from llmc.api import LLM
    from llmc.runtime.types import SamplingParams

    bias = {7: 100.0, 11: -100.0}
    with LLM(serve_engine, device="cpu") as llm:
        ref = llm.generate(PROMPT, SamplingParams(max_new_tokens=6, logit_bias=bias))[0]
    assert ref.token_ids == [7] * 6
    wire = {str(t): b for t, b in bias.items()}  # JSON keys: token ids as strings
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=wire
    )
    assert out.choices[0].text == ref.text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logit_bias=wire,
    )  # fmt: skip
    assert chat.choices[0].message.content == ref.text


def test_greedy_stream_concatenates_to_the_whole_text(client) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stream_usage_comes_last_when_asked(client) -> None:
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_as_token_ids_and_a_list_of_prompts(client) -> None:
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    many = client.completions.create(
        model="tiny", prompt=["a b", "c d"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy: n copies of one answer
    assert many.usage.completion_tokens == 12


def test_n_with_a_seed_is_reproducible(client) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # derived seeds: different samples
    assert a.usage.completion_tokens == 36


def test_streamed_n_interleaves_choices(client) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=3)
    whole = client.completions.create(**kw)
    texts = ["", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


def test_chat_with_system_and_turns(client) -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "m"}]},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=6, temperature=0
    )
    msg = out.choices[0].message
    # OpenAI's bookkeeping fields are accepted and change nothing
    kept = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=6, temperature=0, user="u1",
        metadata={"team": "a"}, store=False, service_tier="auto", parallel_tool_calls=False,
    )  # fmt: skip
    assert kept.choices[0].message.content == msg.content
    assert out.object == "chat.completion" and msg.role == "assistant"
    assert out.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content


def test_chat_prompt_is_the_engine_chat_template(client, serve_engine) -> None:
    from llmc.runtime.tokenizer import Tokenizer

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    ids = Tokenizer.from_dir(serve_engine).apply_chat_template(messages)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == len(ids)


def test_logprobs_name_tokens_by_text(client) -> None:
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value)  # greedy: the best
        assert tok in top
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_readme_serving_snippet_runs(shared_server, monkeypatch, capsys) -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [
        b for b in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M) if "OpenAI(" in b
    ]
    assert len(blocks) == 1, "README.md needs one ```python block with the openai client"
    monkeypatch.setenv("LLMC_URL", shared_server.base_url)
    monkeypatch.setenv("LLMC_MODEL", "tiny")
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.endswith("\n")  # it printed the answer (may be empty)
