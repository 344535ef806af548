"""llmc Responses → OpenAI JSON: completion and chat bodies, stream chunks, logprobs, usage.

``Shape`` holds what every chunk of one HTTP request repeats (id, object, created, model),
pre-encoded: a stream chunk is then a prefix, one small choice object per choice with news,
and a suffix (no dict is built and encoded per token on the hot path). The choice objects
follow OpenAI's field order. Token texts of logprobs are each id decoded alone with the
engine's tokenizer (special tokens kept), ``bytes`` their UTF-8.

Finish reasons: the engine's ``stop`` (EOS, a stop id or string) and ``length`` are
OpenAI's; a request cancelled by the server (drain timeout, shutdown) ends with ``abort``
(vLLM's name).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _js
from typing import Any

from llmc.runtime.types import FinishReason

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
DONE = b"data: [DONE]\n\n"


def finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return FINISH.get(reason, "abort")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class Shape:
    """The repeated part of one request's objects (``chat``: chat.completion objects)."""

    def __init__(self, model: str, chat: bool, include_usage: bool = False) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
            f'"model":{_js(model)},"choices":['
        )
        self._tail = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- stream chunks ------------------------------------------------------------------
    def choice_chunk(
        self,
        index: int,
        text: str,
        reason: str | None,
        logprobs: Any = None,
        first: bool = False,
    ) -> str:
        """One choice of a stream chunk (``first``: the chat role is sent with it)."""
        lp = "null" if logprobs is None else _dumps(logprobs)
        fr = "null" if reason is None else f'"{reason}"'
        if not self.chat:
            return f'{{"index":{index},"text":{_js(text)},"logprobs":{lp},"finish_reason":{fr}}}'
        role = '"role":"assistant",' if first else ""
        return (
            f'{{"index":{index},"delta":{{{role}"content":{_js(text)}}},"logprobs":{lp},'
            f'"finish_reason":{fr}}}'
        )

    def chunk(self, choices: list[str]) -> str:
        return self._head + ",".join(choices) + self._tail

    def usage_chunk(self, usage: dict[str, int]) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {_dumps({**self.header(obj), 'choices': [], 'usage': usage})}\n\n"

    # ---- whole bodies -------------------------------------------------------------------
    def body(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.header(obj), "choices": choices, "usage": usage}

    def choice(self, index: int, text: str, reason: str | None, logprobs: Any) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


TokenTexts = Callable[[int], str]
"""Token id → its text alone (logprobs name tokens by text)."""


def token_texts(tokenizer: Any) -> TokenTexts:
    """The engine tokenizer's cached ``token_text``; ``<id>`` for an engine without one."""
    if tokenizer is None:
        return lambda token_id: f"<{token_id}>"
    return tokenizer.token_text


def completion_logprobs(entries: list[Any], texts: TokenTexts, offset: int) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object of ``entries`` (TokenLogprobs, in order);
    ``offset``: characters of the choice's text before the first of them."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        t = texts(e.token_id)
        tokens.append(t)
        lps.append(e.logprob)
        top: dict[str, float] = {}
        for i, lp in e.top:  # two ids may decode alike: the likelier one names the text
            top.setdefault(texts(i), lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_token(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    t = texts(token_id)
    return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8", "replace"))}


def chat_logprobs(entries: list[Any], texts: TokenTexts) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per token)."""
    return {
        "content": [
            {
                **_chat_token(e.token_id, e.logprob, texts),
                "top_logprobs": [_chat_token(i, lp, texts) for i, lp in e.top],
            }
            for e in entries
        ]
    }
