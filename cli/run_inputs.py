"""Where ``llmc run``'s requests come from: ``--prompt`` texts, ``--input_file`` (text or
JSONL lines with per-request sampling fields) or ``--messages_file`` (one conversation per
line), each made a ``Request`` with the flags' ``SamplingParams``; list flags parsed
(``--stop_token_ids``, ``--logit_bias``). A bad line fails that request alone, its error
naming the file and line; bad flags refuse the command.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmc.base.errors import LlmcError, RequestError, UsageError, did_you_mean
from llmc.cli.options import RUNTIME_KEYS
from llmc.runtime.chat_messages import is_conversation
from llmc.runtime.types import Request, SamplingParams

SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
RUN_KEYS = (
    "engine_dir", "prompt", "input_file", "messages_file", "system", "chat", "stream",
    *SAMPLING_KEYS, *RUNTIME_KEYS,
)  # fmt: skip
JSONL_KEYS = ("prompt", "input_ids", "prompt_token_ids", "messages", "chat", *SAMPLING_KEYS)
LIMIT_NAMES = ("max_new_tokens", "max_tokens")
"""Two names of one sampling limit: a JSONL line's replaces the flags' under either name."""


def int_list(values: list[str] | None, name: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    try:
        return tuple(int(x) for v in values for x in str(v).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--{name} takes integers (repeat it or separate with commas)") from None


def bias_map(values: list[str] | None) -> dict[int, float] | None:
    """``--logit_bias ID:BIAS`` (repeatable, or ID:BIAS,ID:BIAS) as {id: bias}; the ranges
    are SamplingParams' to check."""
    if values is None:
        return None
    out: dict[int, float] = {}
    for item in (x.strip() for v in values for x in str(v).split(",") if x.strip()):
        tid, sep, bias = item.partition(":")
        try:
            if not sep:
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise UsageError(
                f"--logit_bias {item!r}: takes TOKEN_ID:BIAS (e.g. 50256:-100; repeat it or "
                "separate with commas)"
            ) from None
    return out


def _sampling(settings: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """SamplingParams from the flags/profile with ``overrides`` (a JSONL line's fields);
    ``SamplingParams`` checks and normalizes every value (RequestError naming it)."""
    values = {k: settings[k] for k in SAMPLING_KEYS if settings.get(k) is not None}
    if any(k in overrides for k in LIMIT_NAMES):
        for k in LIMIT_NAMES:
            values.pop(k, None)
    values.update(overrides)
    if type(width := values.get("beam_width")) is int and width > 1:  # beam search,
        values.update({"use_beam_search": True, "n": width, **values})  # every beam shown
    return SamplingParams(**values)


def _conversation(messages: Any, system: str | None) -> Any:
    """``messages`` with ``system`` as its first message when it has no system message (a
    value that is not a list of messages is left for ``Request.validate`` to name)."""
    if system is None or not isinstance(messages, list):
        return messages
    if any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _text_request(text: str, sampling: SamplingParams, settings: dict[str, Any]) -> Request:
    """The Request of one text prompt: with ``--system``, a system + user conversation."""
    system, streaming = settings.get("system"), bool(settings.get("stream"))
    if system is not None:
        prompt: Any = _conversation([{"role": "user", "content": text}], system)
        return Request(prompt=prompt, sampling=sampling, apply_chat_template=True,
                       streaming=streaming)  # fmt: skip
    chat = bool(settings.get("chat"))
    return Request(prompt=text, sampling=sampling, apply_chat_template=chat, streaming=streaming)


def _label(messages: list[dict[str, Any]]) -> str:
    """A conversation's label: its last message's text."""
    content = messages[-1].get("content") if messages else None
    return content if isinstance(content, str) else f"<{len(messages)} messages>"


def read_requests(settings: dict[str, Any]) -> list[tuple[str, Request | LlmcError]]:
    """(label, Request or the error that makes it unservable) per prompt, in order. Bad
    sampling flags refuse the command (RequestError); a bad line of an input file fails
    that request alone, its error naming the file and line."""
    prompts = list(settings.get("prompt") or [])
    sources = [n for n in ("input_file", "messages_file") if settings.get(n)]
    if len(sources) + bool(prompts) > 1:
        given = (["--prompt"] if prompts else []) + [f"--{n}" for n in sources]
        raise UsageError(f"give prompts one way: {' and '.join(given)} were both given")
    if not prompts and not sources:
        raise UsageError(
            "no prompt: give --prompt TEXT (repeatable), --input_file FILE or --messages_file "
            "FILE.jsonl"
        )
    defaults = _sampling(settings, {})
    if prompts:
        return [(p, _text_request(p, defaults, settings)) for p in prompts]
    flag = sources[0]
    p = Path(settings[flag])
    try:
        lines = p.read_bytes().split(b"\n")
    except OSError as e:
        raise UsageError(f"--{flag} {p}: cannot be read ({e.strerror or e})") from None
    if flag == "messages_file":
        return _messages_requests(p, lines, defaults, settings)
    chat = bool(settings.get("chat"))
    streaming = bool(settings.get("stream"))
    out: list[tuple[str, Request | LlmcError]] = []
    for n, where, line in _file_lines(p, lines):
        if isinstance(line, LlmcError):
            out.append((f"<line {n}>", line))
            continue
        if not line.lstrip().startswith("{"):
            req = _text_request(line, defaults, settings)
            req.metadata["where"] = where
            out.append((line, req))
            continue
        try:
            label, req = _jsonl_request(line, settings, chat, streaming)
        except LlmcError as e:
            out.append((f"<line {n}>", RequestError(f"{where}: {e}")))
            continue
        req.metadata["where"] = where
        out.append((label, req))
    if not out:
        raise UsageError(f"--input_file {p}: has no prompts")
    return out


def _file_lines(path: Path, lines: list[bytes]) -> Iterator[tuple[int, str, str | LlmcError]]:
    """(line number, ``path:number``, its text or the error of a line that is not UTF-8)
    for every non-blank line of an input file."""
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            yield n, where, raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            yield n, where, RequestError(f"{where}: not valid UTF-8 ({e.reason})")


def _messages_requests(
    path: Path, lines: list[bytes], sampling: SamplingParams, settings: dict[str, Any]
) -> list[tuple[str, Request | LlmcError]]:
    """``--messages_file``: one conversation per line (a JSON list of {role, content});
    a bad line fails that request alone, its error naming the file and line."""
    out: list[tuple[str, Request | LlmcError]] = []
    for n, where, line in _file_lines(path, lines):
        if isinstance(line, LlmcError):
            out.append((f"<line {n}>", line))
            continue
        try:
            messages = json.loads(line)
            if not isinstance(messages, list) or not is_conversation(messages):
                raise RequestError("a line must be a JSON list of {role, content} messages")
            req = Request(
                prompt=_conversation(messages, settings.get("system")),
                sampling=sampling,
                apply_chat_template=True,
                streaming=bool(settings.get("stream")),
            )
        except (json.JSONDecodeError, RecursionError) as e:
            error = RequestError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})")
            out.append((f"<line {n}>", error))
            continue
        except LlmcError as e:
            out.append((f"<line {n}>", RequestError(f"{where}: {e}")))
            continue
        req.metadata["where"] = where
        out.append((_label(req.prompt), req))  # type: ignore[arg-type]
    if not out:
        raise UsageError(f"--messages_file {path}: has no conversations")
    return out


def _jsonl_request(
    line: str, settings: dict[str, Any], chat: bool, streaming: bool
) -> tuple[str, Request]:
    """(label, Request) of one JSONL line; RequestError (without the line's place) if bad."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RequestError(f"not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(obj, dict):
        raise RequestError("a JSONL line must be an object")
    for key in obj:
        if key not in JSONL_KEYS:
            raise RequestError(f"unknown key {key!r}" + did_you_mean(key, JSONL_KEYS))
    given = [k for k in ("prompt", "input_ids", "prompt_token_ids", "messages") if k in obj]
    if len(given) > 1:
        raise RequestError(
            f"give one of {', '.join(given)}, not {'both' if len(given) == 2 else 'several'}"
        )
    ids = obj.get("input_ids", obj.get("prompt_token_ids"))
    sampling = _sampling(settings, {k: v for k, v in obj.items() if k in SAMPLING_KEYS})
    if "messages" in obj:
        req = Request(
            prompt=_conversation(obj["messages"], settings.get("system")),
            sampling=sampling,
            apply_chat_template=True,
            streaming=streaming,
        )
        return _label(req.prompt), req  # type: ignore[arg-type]
    prompt = obj.get("prompt")
    if isinstance(prompt, str) and settings.get("system") is not None and "chat" not in obj:
        return prompt, _text_request(prompt, sampling, settings)
    req = Request(
        prompt=prompt,
        prompt_token_ids=ids,
        sampling=sampling,
        apply_chat_template=obj.get("chat", chat),
        streaming=streaming,
    )
    label = prompt if isinstance(prompt, str) else f"<{len(req.prompt_token_ids or [])} ids>"
    return label, req
