"""OpenAI request bodies → the llmc Requests that serve them, and llmc errors → OpenAI ones.

``completion_plan`` / ``chat_plan`` turn a validated body into a ``Plan``: the prompts as
token ids (text through the engine's tokenizer, chat turns through its chat template) and
one ``SamplingParams`` per choice. ``n`` > 1 is served as n engine requests of one prompt
(the runtime has no KV-sharing n yet): with a ``seed``, choice i samples with ``seed + i``,
so a seeded request is reproducible; without one each request draws its own stream.

Range checks are ``SamplingParams``'s (the one home of the rules); its RequestError names the
llmc field, which ``sampling_error`` maps back to the OpenAI parameter the client sent.
Engine refusals that come back in a final Response (prompt over max_input_len, prompt +
max_tokens over max_seq_len, a prompt id outside the vocabulary) map to 400 with the param
they concern (``response_error``); any other failure of a request — a ``RequestFault`` in a
step, an engine failure — is a 500.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import LlmcError, RequestError
from llmc.runtime.types import INT32_MAX, Request, SamplingParams
from llmc.serve.api_errors import APIError, bad_request
from llmc.serve.schema import ChatCompletionRequest, CompletionRequest

MAX_N = 128
"""Most choices one request may ask for (each is an engine request)."""
MAX_PROMPTS = 1024
_ID_PARAMS = ("stop_token_ids ", "logit_bias ")
"""Request fields of token ids the engine checks against its vocabulary at admission."""
_BAD_FIELD = re.compile(r"^(?:sampling parameter|request field) (\w+)=")
_REQUEST_PREFIX = re.compile(r"^request \d+: ")


@dataclass(frozen=True)
class Plan:
    """What one HTTP request runs: ``len(prompts) * n`` engine requests, choice index
    ``prompt_index * n + i`` (OpenAI's order)."""

    prompts: list[list[int]]
    sampling: list[SamplingParams]
    """One per choice of a prompt (length n)."""
    streaming: bool
    include_usage: bool
    prompt_param: str
    tokens_param: str
    num_top_logprobs: int | None = None
    logprobs_style: str = "completion"

    @property
    def n(self) -> int:
        return len(self.sampling)

    def requests(self) -> list[Request]:
        return [
            Request(prompt_token_ids=ids, sampling=sp, streaming=self.streaming)
            for ids in self.prompts
            for sp in self.sampling
        ]


def _common(body: Any) -> None:
    """Refusals both endpoints share: what llmc does not do, said as such."""
    if not 1 <= body.n <= MAX_N:
        raise bad_request(f"n={body.n}: must be in [1, {MAX_N}]", param="n")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def _sampling(
    body: Any, max_tokens: int | None, max_seq_len: int, logprobs: int | None, tokens_param: str
) -> list[SamplingParams]:
    """One SamplingParams per choice (seeds derived per choice); RequestError → 400."""
    top_k = body.top_k if body.top_k is not None else 0
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    values: dict[str, Any] = {
        "max_new_tokens": max_tokens if max_tokens is not None else max_seq_len,
        "clamp_max_new_tokens": max_tokens is None,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": top_k,
        "min_p": 0.0 if body.min_p is None else body.min_p,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "stop": () if body.stop is None else body.stop,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "logit_bias": body.logit_bias or (),  # {"token id": bias}: SamplingParams reads the keys
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
    }
    seed = body.seed
    out = []
    for i in range(body.n):
        if seed is not None:
            values["seed"] = seed + i
        try:
            out.append(SamplingParams(**values))
        except RequestError as e:
            raise sampling_error(e, tokens_param, body) from None
    return out


def sampling_error(error: RequestError, tokens_param: str, body: Any) -> APIError:
    """The SamplingParams refusal as a 400 naming the OpenAI parameter."""
    message = str(error)
    m = _BAD_FIELD.match(message)
    if m is None:
        return bad_request(message)
    name = m.group(1)
    param = {
        "max_new_tokens": tokens_param,
        "logprobs": "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs",
    }.get(name, name)
    return bad_request(param + message[m.end(1) :], param=param)


def _ids(tokenizer: Any, text: str, param: str) -> list[int]:
    if tokenizer is None:
        raise bad_request("the engine has no tokenizer: send the prompt as token ids", param)
    try:
        return tokenizer.encode(text)
    except LlmcError as e:
        raise bad_request(str(e), param=param) from None


def completion_plan(body: CompletionRequest, tokenizer: Any, max_seq_len: int) -> Plan:
    """The Plan of a ``/v1/completions`` body (prompt: text, texts, ids or lists of ids)."""
    _common(body)
    if body.echo:
        raise bad_request("echo=true is not supported by llmc serve", param="echo")
    if body.suffix:
        raise bad_request("suffix is not supported by llmc serve", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported by llmc serve", "best_of")
    p = body.prompt
    if isinstance(p, str):
        prompts = [_ids(tokenizer, p, "prompt")]
    elif not p:
        raise bad_request("prompt is empty", param="prompt")
    elif isinstance(p[0], str):
        prompts = [_ids(tokenizer, t, "prompt") for t in p]  # type: ignore[arg-type]
    elif isinstance(p[0], int):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    if len(prompts) > MAX_PROMPTS or len(prompts) * body.n > MAX_N * 8:
        raise bad_request(f"{len(prompts)} prompts × n={body.n} is too many", param="prompt")
    if any(not ids for ids in prompts):
        raise bad_request("prompt is empty", param="prompt")
    if any(not 0 <= t <= INT32_MAX for ids in prompts for t in ids):
        raise bad_request("prompt token ids must be non-negative integers", param="prompt")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise bad_request(f"max_tokens={body.max_tokens}: must be >= 1", param="max_tokens")
    sampling = _sampling(body, body.max_tokens, max_seq_len, body.logprobs, "max_tokens")
    return Plan(
        prompts=prompts,
        sampling=sampling,
        streaming=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        prompt_param="prompt",
        tokens_param="max_tokens",
        num_top_logprobs=body.logprobs,
        logprobs_style="completion",
    )


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The turns as the chat template reads them (text parts joined)."""
    out = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        turn: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            turn["name"] = m.name
        out.append(turn)
    return out


def chat_plan(body: ChatCompletionRequest, tokenizer: Any, max_seq_len: int) -> Plan:
    """The Plan of a ``/v1/chat/completions`` body: turns through the chat template."""
    tokens_param = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    _common(body)
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(f"response_format {fmt!r} is not supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{tokens_param}={max_tokens}: must be >= 1", param=tokens_param)
    if tokenizer is None:
        raise bad_request("the engine has no tokenizer, so no chat template", param="messages")
    try:
        ids = list(
            tokenizer.apply_chat_template(
                chat_messages(body), add_generation_prompt=body.add_generation_prompt
            )
        )
    except LlmcError as e:
        raise bad_request(str(e), param="messages") from None
    if not ids:
        raise bad_request("the chat template rendered an empty prompt", param="messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = _sampling(body, max_tokens, max_seq_len, logprobs, tokens_param)
    return Plan(
        prompts=[ids],
        sampling=sampling,
        streaming=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        prompt_param="messages",
        tokens_param=tokens_param,
        num_top_logprobs=logprobs,
        logprobs_style="chat",
    )


def strip_request_id(message: str) -> str:
    """The engine prefixes its own request id; a client knows none of them."""
    return _REQUEST_PREFIX.sub("", message, count=1)


def response_error(plan: Plan, message: str, error_code: int | None) -> APIError:
    """A request's final error Response → 400 when the engine refused it at admission
    (prompt over max_input_len, prompt + max_tokens over max_seq_len or the KV pool, a token
    id outside the vocabulary, an empty prompt), naming the param it concerns; any other
    failure (a RequestFault inside a step, an engine failure) is the server's: 500."""
    text = strip_request_id(message)
    refused = error_code == RequestError.exit_code
    if refused and "vocabulary" in text and text.startswith(_ID_PARAMS):
        return bad_request(text, param=text.split(" ", 1)[0])  # stop_token_ids, logit_bias
    if refused and ("max_input_len" in text or "vocabulary" in text or "is empty" in text):
        code = "context_length_exceeded" if "max_input_len" in text else None
        return bad_request(text, param=plan.prompt_param, code=code)
    if refused and ("max_seq_len" in text or "KV-cache blocks" in text):
        text = text.replace(" or set clamp_max_new_tokens", "")  # not an OpenAI field
        text = text.replace("max_new_tokens", plan.tokens_param)
        return bad_request(text, param=plan.tokens_param, code="context_length_exceeded")
    return APIError(500, f"the request failed: {text}", code="request_failed")
