"""Chat conversations as request prompts: their shape check, and the error of one passed
where a prompt (text or token ids) goes (no torch).

A conversation is a list of messages, each a dict with a string ``role`` (system, user,
assistant, tool) and a ``content`` (a string, None, or a list of content parts), rendered by
the engine's chat template (``runtime/tokenizer.py``). The check runs in ``Request.validate``;
the template's own limits (time, size) are the tokenizer's.
"""

from __future__ import annotations

from typing import Any

from llmc.base.errors import RequestError

MAX_CHAT_MESSAGES = 4096
"""Most messages one conversation may have."""
RESERVED_CHAT_KWARGS = frozenset({"messages", "tokenize"})
"""Template arguments llmc sets itself."""


def is_conversation(value: Any) -> bool:
    """Whether ``value`` looks like a chat conversation: a non-empty list (or tuple) whose
    first element is a dict."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


def check_conversation(value: Any, chat: bool, what: str = "prompt") -> list[dict[str, Any]]:
    """``value`` (a conversation) as a list of checked messages. ``chat`` False: it was
    passed as a plain prompt, which is refused with what was passed and what is expected."""
    n = len(value)
    if not chat:
        raise RequestError(
            f"{what} is a list of {n} chat message{'s' if n != 1 else ''} ({{role, content}} "
            "dicts), not a prompt: a prompt is a string or a list of token ids; send a "
            "conversation through LLM.chat(messages), or as Request(prompt=messages, "
            "apply_chat_template=True)"
        )
    if n > MAX_CHAT_MESSAGES:
        raise RequestError(f"{what}: {n} chat messages are more than {MAX_CHAT_MESSAGES}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not all(isinstance(k, str) for k in m):
            raise RequestError(f"{what}: chat message {i} must be a dict with string keys")
        if not isinstance(m.get("role"), str):
            raise RequestError(
                f"{what}: chat message {i} needs a string 'role' (system, user, assistant)"
            )
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise RequestError(
                f"{what}: chat message {i} ({m['role']}): 'content' must be a string, got "
                f"{type(m.get('content')).__name__}"
            )
    return list(value)


def check_chat_kwargs(kwargs: Any, chat: bool) -> None:
    """``Request.chat_template_kwargs``: None, or a dict with string keys (not the ones llmc
    sets) for a request that applies the chat template."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError("request field chat_template_kwargs must be a dict with string keys")
    reserved = sorted(RESERVED_CHAT_KWARGS & set(kwargs))
    if reserved:
        raise RequestError(f"request field chat_template_kwargs: {reserved[0]!r} is llmc's to set")
    if not chat:
        raise RequestError("request field chat_template_kwargs needs apply_chat_template=True")
