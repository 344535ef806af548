"""The server's pure parts: config, body parsing and translation to SamplingParams, error
mapping, chunk formatting, the response channel; and `llmc serve`'s command-line refusals."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.responses import Response
from llmc.runtime.types import FinishReason, Request
from llmc.serve.api_errors import APIError
from llmc.serve.bridge import Channel, ResponseBridge
from llmc.serve.config import EngineSpec, ServeConfig
from llmc.serve.formatting import Shape, finish_reason
from llmc.serve.schema import ChatCompletionRequest, CompletionRequest, parse_body
from llmc.serve.translate import chat_plan, completion_plan, response_error


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.encode("".join(f"{m['role']}:{m['content']};" for m in messages))


def _completion(**fields):
    body = parse_body(CompletionRequest, json.dumps({"model": "m", **fields}).encode())
    return completion_plan(body, _Tok(), 128)


def test_config_and_engine_specs() -> None:
    assert EngineSpec.parse("llama=engines/x") == EngineSpec("llama", "engines/x")
    for bad in ("llama", "=x", "llama="):
        with pytest.raises(UsageError, match="NAME=DIR"):
            EngineSpec.parse(bad)
    with pytest.raises(ConfigError, match="model name"):
        EngineSpec("bad name!", "x")
    spec = EngineSpec("a", "x")
    with pytest.raises(UsageError, match="no engine"):
        ServeConfig(engines=())
    for field, value in (("routing", "random"), ("port", 70000), ("max_queue", -1),
                         ("drain_timeout", float("inf")), ("api_key", "")):  # fmt: skip
        with pytest.raises(ConfigError, match=field):
            ServeConfig(engines=(spec,), **{field: value})
    assert ServeConfig(engines=(spec, spec, EngineSpec("b", "y"))).model_names == ("a", "b")


def test_openai_defaults_and_fields_become_sampling_params() -> None:
    plan = _completion(prompt="hi")
    sp = plan.sampling[0]
    assert plan.prompts == [[104, 105]] and sp.max_new_tokens == 16 and sp.temperature == 1.0
    plan = _completion(
        prompt=[[1, 2], [3]], n=2, seed=5, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1,
        stop="x", presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        ignore_eos=True, logprobs=3, max_tokens=9,
    )  # fmt: skip
    assert [sp.seed for sp in plan.sampling] == [5, 6]  # derived per choice
    sp = plan.sampling[0]
    assert (sp.top_k, sp.stop, sp.logprobs, sp.ignore_eos, sp.max_new_tokens) == (
        0, ("x",), 3, True, 9,
    )  # fmt: skip
    assert len(plan.requests()) == 4 and plan.prompts == [[1, 2], [3]]
    chat = parse_body(
        ChatCompletionRequest,
        b'{"model": "m", "messages": [{"role": "user", "content": "q"}], "logprobs": true}',
    )
    plan = chat_plan(chat, _Tok(), 128)
    sp = plan.sampling[0]
    assert sp.clamp_max_new_tokens and sp.max_new_tokens == 128 and sp.logprobs == 0
    assert plan.prompt_param == "messages" and plan.tokens_param == "max_tokens"


@pytest.mark.parametrize(
    "body,param",
    [
        (b'{"model": "m"}', "prompt"),
        (b'{"model": "m", "prompt": "x", "n": 1.5}', "n"),
        (b'{"model": "m", "prompt": "x", "stream_options": {"foo": 1}}', "stream_options.foo"),
        (b'{"model": "m", "prompt": [1, "a"]}', "prompt"),
        (b"[]", None),
        (b"", None),
        (b"{", None),
    ],
)
def test_bodies_refused_naming_the_field(body, param) -> None:
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param


def test_engine_refusals_map_to_params() -> None:
    plan = _completion(prompt="x", max_tokens=4)
    e = response_error(plan, "request 3: prompt has 99 tokens, more than the engine's "
                       "max_input_len=64", 8)  # fmt: skip
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    assert not e.message.startswith("request 3")
    e = response_error(plan, "request 1: prompt (5 tokens) + max_new_tokens (800) = 805 "
                       "exceeds the engine's max_seq_len=128; lower max_new_tokens or set "
                       "clamp_max_new_tokens", 8)  # fmt: skip
    assert (e.status, e.param) == (400, "max_tokens")
    assert "max_new_tokens" not in e.message and "clamp" not in e.message
    e = response_error(plan, "request 2: building its sampling columns failed (ValueError)", 8)
    assert e.status == 500 and e.type == "server_error"
    assert response_error(plan, "engine failure: boom", 7).status == 500


def test_chunks_are_openai_json() -> None:
    shape = Shape('m"x', chat=True, include_usage=True)
    chunk = shape.chunk([shape.choice_chunk(0, 'a"\n\u00e9', None, first=True),
                         shape.choice_chunk(1, "", "stop")])  # fmt: skip
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    obj = json.loads(chunk[6:])
    assert obj["object"] == "chat.completion.chunk" and obj["model"] == 'm"x'
    assert obj["usage"] is None and obj["id"] == shape.id
    assert obj["choices"][0]["delta"] == {"role": "assistant", "content": 'a"\n\u00e9'}
    assert obj["choices"][1] == {"index": 1, "delta": {"content": ""}, "logprobs": None,
                                 "finish_reason": "stop"}  # fmt: skip
    usage = json.loads(shape.usage_chunk({"prompt_tokens": 1})[6:])
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 1}
    plain = Shape("m", chat=False)
    obj = json.loads(plain.chunk([plain.choice_chunk(0, "t", "length")])[6:])
    assert "usage" not in obj and obj["choices"][0]["text"] == "t"
    assert [finish_reason(r) for r in FinishReason] == ["length", "stop", "abort", "abort"]


def test_channel_delivers_batches_and_wakes_on_interrupt() -> None:
    async def main():
        ch = Channel()
        ch.push(1.0, "a")
        ch.push(2.0, "b")
        assert await ch.take() == [(1.0, "a"), (2.0, "b")]
        waiter = asyncio.ensure_future(ch.take())
        await asyncio.sleep(0)
        ch.interrupt()
        assert await asyncio.wait_for(waiter, 5) == []

    asyncio.run(main())


def _serve_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmc.cli.main", "serve", "--host", "127.0.0.1", *args],
        capture_output=True, text=True, timeout=120, env={"PYTHONSAFEPATH": "1",
                                                          "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_serve_command_line_refusals(tmp_path, tiny_llama_dir) -> None:
    r = _serve_cli()
    assert r.returncode == 2 and "no engine" in r.stderr
    r = _serve_cli("--engine", "oops")
    assert r.returncode == 2 and "NAME=DIR" in r.stderr
    r = _serve_cli("--engine_dir", str(tmp_path), "--routing", "random")
    assert r.returncode == 3 and "round_robin" in r.stderr
    r = _serve_cli("--engine_dir", str(tmp_path / "missing"), "--port", "0")
    assert r.returncode == 7 and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr
    # a checkpoint directory is not an engine: refused, not built on the fly (LLM(model=)'s rule)
    r = _serve_cli("--engine_dir", str(tiny_llama_dir), "--port", "0")
    assert r.returncode == 7 and "manifest" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


class _FakeEngine:
    """What ResponseBridge needs of an LLM: an Executor whose loop thread hands each
    step's Responses to the response sink, as ``Executor.set_response_sink`` does."""

    def __init__(self) -> None:
        self.executor = self
        self.sink = None
        self.next_id = 0

    def set_response_sink(self, sink) -> None:
        self.sink = sink

    def enqueue_request(self, request) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        return rid

    def emit(self, rid: int, final: bool) -> None:
        self.sink([Response(rid, [1], "a", is_final=final)])

    def cancel_request(self, rid: int) -> bool:
        return False


def test_the_bridge_wakes_at_once_for_an_idle_server_and_each_token() -> None:
    """A request to an idle bridge and each later token reach the event loop as soon as the
    engine thread posts them (no poll interval, no dispatcher thread in between); after
    ``close`` the Executor keeps its Responses again."""
    engine = _FakeEngine()

    async def main() -> list[float]:
        bridge = ResponseBridge(engine, asyncio.get_running_loop(), "t")
        lags = []
        try:
            for _ in range(5):
                await asyncio.sleep(0.05)  # idle: nothing open
                channel = Channel()
                [rid] = bridge.submit([Request(prompt_token_ids=[1])], channel)
                for final in (False, True):
                    t0 = time.perf_counter()
                    threading.Thread(target=engine.emit, args=(rid, final)).start()
                    items = await asyncio.wait_for(channel.take(), 5.0)
                    lags.append(time.perf_counter() - t0)
                    assert [r.is_final for _, r in items] == [final]
            assert bridge.open == 0
        finally:
            bridge.close()
        assert engine.sink is None
        return lags

    lags = sorted(asyncio.run(main()))
    assert lags[len(lags) // 2] < 0.05, lags  # generous for a loaded 2-core machine
