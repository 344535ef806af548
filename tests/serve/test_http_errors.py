"""`llmc serve` over raw HTTP: every refusal with its status and OpenAI error object, the API
key, the body limit, and /metrics as Prometheus text that moves with traffic."""

from __future__ import annotations

import json

import pytest

from helpers.server import ServerProcess, metric, metrics, post_json, request

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(serve_engine):
    s = ServerProcess.start(
        ["--engine", f"tiny={serve_engine}", "--max_body_bytes", "4096"],
        env={"LLMC_API_KEY": KEY},
    )
    yield s
    s.stop()


def error_of(status: int, body: object, want: int, param: object = None) -> dict:
    assert status == want, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    assert err["type"] == ("server_error" if want >= 500 else "invalid_request_error")
    assert err["param"] == param, err
    return err


def completion(server, headers=AUTH, **fields) -> tuple[int, dict, object]:
    return post_json(server.port, "/v1/completions", {"model": "tiny", **fields}, headers)


def test_the_key_is_required_on_v1_only(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, _, body = completion(server, headers, prompt="a", max_tokens=1)
        assert error_of(status, body, 401)["code"] == "invalid_api_key"
    status, _, _ = request(server.port, "GET", "/v1/models")
    assert status == 401
    assert completion(server, prompt="a", max_tokens=1)[0] == 200
    assert request(server.port, "GET", "/health")[0] == 200
    assert request(server.port, "GET", "/metrics")[0] == 200


@pytest.mark.parametrize(
    "fields,param,needle",
    [
        ({"temperature": -1}, "temperature", "temperature=-1"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"top_k": -3}, "top_k", "top_k"),
        ({"min_p": 2}, "min_p", "min_p"),
        ({"presence_penalty": 5}, "presence_penalty", "presence_penalty"),
        ({"frequency_penalty": -9}, "frequency_penalty", "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"max_tokens": 500}, "max_tokens", "max_seq_len=128"),
        ({"logprobs": 99}, "logprobs", "logprobs"),
        ({"n": 0}, "n", "n=0"),
        ({"stop": [""]}, "stop", "stop"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"max_tokens": True}, "max_tokens", "valid integer"),
        ({"prompt": "x" * 100}, "prompt", "max_input_len=64"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, 99999]}, "prompt", "vocabulary"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"logit_bias": {"1": 500}}, "logit_bias", "not in [-100, 100]"),
        ({"logit_bias": {"one": 5}}, "logit_bias", "not a non-negative integer token id"),
        ({"logit_bias": {"99999": 5}}, "logit_bias", "vocabulary"),
        ({"stop_token_ids": [99999]}, "stop_token_ids", "vocabulary"),
        ({"echo": True}, "echo", "not supported"),
        ({"frobnicate": 1}, "frobnicate", "unrecognized"),
    ],
)
def test_bad_fields_answer_400_naming_them(server, fields, param, needle) -> None:
    status, _, body = completion(server, **{"prompt": "abc", "max_tokens": 4, **fields})
    err = error_of(status, body, 400, param)
    assert needle in err["message"]
    if needle.startswith(("max_seq_len", "max_input_len")):
        assert err["code"] == "context_length_exceeded"


def test_streamed_refusals_are_400_too(server) -> None:
    status, _, body = completion(server, prompt="x" * 100, max_tokens=4, stream=True)
    assert error_of(status, body, 400, "prompt")["code"] == "context_length_exceeded"


def test_chat_refusals(server) -> None:
    def chat(**fields):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
        return post_json(server.port, "/v1/chat/completions", body, AUTH)

    error_of(*chat(messages=[])[::2], 400, "messages")
    error_of(*chat(messages=[{"role": "robot", "content": "x"}])[::2], 400, "messages[0].role")
    error_of(*chat(max_completion_tokens=900)[::2], 400, "max_completion_tokens")
    error_of(*chat(top_logprobs=2)[::2], 400, "top_logprobs")
    error_of(*chat(logprobs=True, top_logprobs=50)[::2], 400, "top_logprobs")
    error_of(*chat(messages=[{"role": "user", "content": "y" * 80}])[::2], 400, "messages")
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    error_of(*chat(messages=[{"role": "user", "content": image}])[::2], 400, "messages[0].content")
    many = {f"k{i}": "v" for i in range(17)}  # OpenAI's limit: 16 metadata pairs
    error_of(*chat(metadata=many)[::2], 400, "metadata")
    error_of(*chat(metadata={"k": 1})[::2], 400, "metadata.k")
    error_of(*chat(store="yes")[::2], 400, "store")


def test_unknown_model_route_method_and_bad_json(server) -> None:
    status, _, body = completion(server, model="gpt-9", prompt="a")
    assert error_of(status, body, 404, "model")["code"] == "model_not_found"
    status, _, raw = request(server.port, "GET", "/v1/nothing", headers=AUTH)
    error_of(status, json.loads(raw), 404)
    status, _, raw = request(server.port, "GET", "/v1/completions", headers=AUTH)
    error_of(status, json.loads(raw), 405)
    for raw_body in (b"{not json", b"[1, 2]", b""):
        status, _, raw = request(server.port, "POST", "/v1/completions", raw_body, AUTH)
        error_of(status, json.loads(raw), 400)
    status, _, body = completion(server, prompt=None)
    error_of(status, body, 400, "prompt")


def test_a_body_over_the_limit_is_413(server) -> None:
    status, _, body = completion(server, prompt="a" * 5000, max_tokens=1)
    assert error_of(status, body, 413)["code"] == "request_too_large"


def test_metrics_are_prometheus_text_that_moves(server) -> None:
    before = metrics(server.port)
    assert completion(server, prompt="abc", max_tokens=3, temperature=0)[0] == 200
    status, _, raw = request(
        server.port, "POST", "/v1/completions",
        json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}).encode(),
        AUTH,
    )  # fmt: skip
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert completion(server, prompt="abc", temperature=-1)[0] == 400
    after = metrics(server.port)

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("llmc_requests_total", model="tiny", outcome="success") == 2
    assert moved("llmc_requests_total", model="tiny", outcome="client_error") == 1
    assert moved("llmc_generation_tokens_total", model="tiny") == 6
    assert moved("llmc_prompt_tokens_total", model="tiny") > 0
    assert moved("llmc_e2e_request_latency_seconds_count", model="tiny") == 2  # served ones
    assert moved("llmc_time_to_first_token_seconds_count", model="tiny") == 1
    assert moved("llmc_inter_token_latency_seconds_count", model="tiny") == 2
    stages = {st: moved("llmc_first_token_stage_seconds_sum", model="tiny", stage=st)
              for st in ("admit", "queue", "compute", "deliver")}  # fmt: skip
    for st in stages:  # the streamed request's TTFT, split (each stage once, >= 0)
        assert moved("llmc_first_token_stage_seconds_count", model="tiny", stage=st) == 1, st
        assert stages[st] >= 0, st
    assert stages["compute"] > 0  # a prefill ran
    ttft = moved("llmc_time_to_first_token_seconds_sum", model="tiny")
    assert (
        ttft * 0.999
        <= sum(stages.values())
        <= moved("llmc_e2e_request_latency_seconds_sum", model="tiny")
    )
    for name in ("llmc_requests_running", "llmc_requests_waiting", "llmc_kv_cache_blocks_used"):
        assert metric(after, name, model="tiny") == 0, name
    assert metric(after, "llmc_kv_cache_blocks_total", model="tiny") > 0
    assert ("llmc_prefix_cache_hits_total", (("model", "tiny"), ("replica", "0"))) in after
    assert ("llmc_preemptions_total", (("model", "tiny"), ("replica", "0"))) in after
