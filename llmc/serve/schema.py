"""OpenAI request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic).

Strict types (a string where a number belongs, ``true`` for an integer, and unknown fields
are refused, as OpenAI refuses an unrecognized argument); ranges are not checked here but
by ``SamplingParams`` (the one home of every sampling rule), through ``translate``.
Defaults are OpenAI's (completions: ``max_tokens`` 16, ``temperature`` 1); chat's bookkeeping
fields (``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``) are accepted and
ignored, as vLLM does. Beside OpenAI's
fields, the extensions vLLM and TensorRT-LLM's servers accept: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmc.serve.api_errors import APIError, bad_request


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # OpenAI's bookkeeping fields, accepted and ignored as vLLM does (llmc stores nothing,
    # has one service tier, and tools are refused, so parallel_tool_calls changes nothing)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None


def _param(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') → 'messages[0].content' (OpenAI's param spelling)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]"):
            break  # pydantic names the union member it tried; the field is enough
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_body(model: type[_Body], body: bytes) -> Any:
    """The request body validated as ``model``; APIError 400 naming the field if not."""
    if not body.strip():
        raise bad_request("the request has no body: send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        loc = tuple(first.get("loc", ()))
        kind = first.get("type", "")
        if kind == "json_invalid":
            raise bad_request(
                "could not parse the JSON body of the request: " + str(first.get("msg", ""))
            ) from None
        if kind == "model_type" and not loc:
            raise bad_request("the request body must be a JSON object") from None
        param = _param(loc) or None
        if kind == "extra_forbidden":
            raise bad_request(
                f"unrecognized request argument supplied: {param}", param=param
            ) from None
        if kind == "missing":
            raise bad_request(f"missing required parameter: {param}", param=param) from None
        raise APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param) from None
