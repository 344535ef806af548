"""Several engines behind one server: ``model`` picks the engine, replicas of one model take
turns under round_robin; the policies themselves; a failure inside one request's processing
answers 500 while the server keeps serving."""

from __future__ import annotations

import gc
import json
import threading
import time

import pytest

from helpers.engines import SMALL_LIMITS
from helpers.server import metric, metrics, post_json, request
from llmc.serve.routing import LeastLoaded, RoundRobin


def _text(port: int, model: str, prompt: str = "abc") -> str:
    status, _, body = post_json(
        port, "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
    )  # fmt: skip
    assert status == 200, body
    return body["choices"][0]["text"]


def test_model_picks_the_engine_and_replicas_alternate(
    start_server, serve_engine, tiny_engine, tiny_qwen2_dir
) -> None:
    qwen = tiny_engine(tiny_qwen2_dir, **SMALL_LIMITS)
    server = start_server(
        "--engine", f"llama={serve_engine}", "--engine", f"qwen={qwen}", "--engine", f"qwen={qwen}"
    )  # fmt: skip
    status, _, body = request(server.port, "GET", "/v1/models")
    assert status == 200 and b'"replicas":2' in body

    from llmc.api import LLM
    from llmc.runtime.types import SamplingParams

    sp = SamplingParams(max_new_tokens=8)
    for model, engine in (("llama", serve_engine), ("qwen", qwen)):
        with LLM(engine, device="cpu") as llm:
            assert _text(server.port, model) == llm.generate("abc", sp)[0].text, model

    def routed(replica: str) -> float:
        return metric(metrics(server.port), "llmc_replica_requests_total", model="qwen",
                      replica=replica)  # fmt: skip

    seen = []
    for _ in range(4):
        before = (routed("0"), routed("1"))
        _text(server.port, "qwen")
        seen.append(0 if routed("0") > before[0] else 1)
    assert seen in ([0, 1, 0, 1], [1, 0, 1, 0])


class _R:
    def __init__(self, load: int) -> None:
        self.load = load


def test_policies() -> None:
    rr = RoundRobin()
    reps = [_R(5), _R(0), _R(3)]
    assert [rr.pick(reps) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert [rr.pick(reps[:2]) for _ in range(3)] == [0, 1, 0]  # a replica left the set
    ll = LeastLoaded()
    assert ll.pick(reps) == 1
    assert ll.pick([_R(2), _R(2)]) == 0


@pytest.fixture
def inproc_server(serve_engine):
    """A server in a thread of this process (so a test can break one of its functions)."""
    from llmc.runtime.engine_runtime import RuntimeConfig
    from llmc.serve.config import EngineSpec, ServeConfig
    from llmc.serve.server import make_server

    config = ServeConfig(
        engines=(EngineSpec("tiny", str(serve_engine)),), runtime=RuntimeConfig(device="cpu"),
        port=0,
    )  # fmt: skip
    lines: list[str] = []
    server = make_server(config, lines.append)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while server.state.phase != "ready":
        assert time.monotonic() < deadline and thread.is_alive(), lines
        time.sleep(0.05)
    port = int(next(x for x in lines if "listening" in x).rsplit(":", 1)[1])
    assert gc.get_freeze_count() > 0  # the heap frozen once ready (llmc.runtime.gc_heap)
    yield port
    server.should_exit = True
    thread.join(30)
    server.state.pool.shutdown()
    assert gc.get_freeze_count() == 0  # and given back by the server's shutdown


def test_a_failing_request_is_500_and_the_server_keeps_serving(inproc_server, monkeypatch):
    from llmc.runtime.tokenizer import Tokenizer

    def broken(self, token_id):
        raise RuntimeError("token text exploded")

    monkeypatch.setattr(Tokenizer, "token_text", broken)
    port = inproc_server
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "logprobs": 1}
    status, _, answer = post_json(port, "/v1/completions", body)
    assert status == 500 and answer["error"]["type"] == "server_error"
    assert "exploded" not in answer["error"]["message"] and "Traceback" not in str(answer)
    status, _, raw = request(
        port, "POST", "/v1/completions", json.dumps({**body, "stream": True}).encode()
    )
    assert status == 200 and b'"server_error"' in raw and raw.endswith(b"data: [DONE]\n\n")
    assert _text(port, "tiny")  # the next request is served
    assert metric(metrics(port), "llmc_requests_total", outcome="server_error") == 2
    deadline = time.monotonic() + 10  # the failed requests' blocks are freed
    while metric(metrics(port), "llmc_kv_cache_blocks_used"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
