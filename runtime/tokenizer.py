"""Tokenizer of an engine: ``tokenizer.json`` (HF ``tokenizers``) + chat template.

Owns text ↔ token ids for the runtime and nothing else. Loaded from a directory holding
``tokenizer.json`` and optionally ``tokenizer_config.json`` (special tokens, a
``chat_template``), ``chat_template.jinja`` or ``chat_template.json`` (where transformers 5
writes the template). The chat template is rendered with jinja2 the way transformers does
(sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
``tojson``), so ``apply_chat_template`` gives the same ids as transformers'.

Invariants: ``encode`` follows the tokenizer.json post-processor (BOS where the model wants
it); ``decode`` skips special tokens by default; ``eos_token_ids`` is the union of the ids
given by the caller (the model config) and the tokenizer config's ``eos_token``; a prompt
the tokenizer rejects and a chat template that fails, runs longer than ``chat_timeout_s`` or
produces more than ``chat_max_chars`` are a RequestError of that request (the render runs
in the caller's thread, off the Executor's lock).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from llmc.base.errors import EngineError, RequestError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
CHAT_TIMEOUT_S = 2.0
"""Longest a chat template may render one request (real templates take milliseconds)."""
CHAT_MAX_CHARS = 4 << 20
"""Most characters a chat template may produce (far more than any max_input_len holds)."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    js = directory / "chat_template.json"
    if tpl is None and js.is_file():
        tpl = json.loads(js.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


class Tokenizer:
    """Encode/decode and chat formatting of one model."""

    def __init__(
        self,
        tokenizer: Any,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
        source: str = "tokenizer",
    ) -> None:
        self._tok = tokenizer
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.source = source
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            content = _token_content(self.config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
        eos_tok = self.special_tokens.get("eos_token")
        if eos_tok is not None:
            eos_id = self._tok.token_to_id(eos_tok)
            if eos_id is not None and eos_id not in eos:
                eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        bos_tok = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = (
            self._tok.token_to_id(bos_tok) if bos_tok is not None else None
        )
        self._register_special_tokens()
        self.special_token_ids = frozenset(
            i for i, t in self._added_tokens() if getattr(t, "special", False)
        )
        self._template = None
        self._token_texts: dict[int, str] = {}
        self.chat_timeout_s = CHAT_TIMEOUT_S
        self.chat_max_chars = CHAT_MAX_CHARS

    def _register_special_tokens(self) -> None:
        """The config's special tokens (bos/eos/unk/pad, ``additional_special_tokens``) that
        are in the vocabulary but not added tokens of tokenizer.json become special added
        tokens, as transformers registers them: ``<s>`` in a chat template's text is then
        one token, as in transformers' ``apply_chat_template``."""
        extra = self.config.get("additional_special_tokens")
        names = [*self.special_tokens.values(), *(extra if isinstance(extra, list) else [])]
        added = {getattr(t, "content", None) for _, t in self._added_tokens()}
        missing = [
            c
            for c in dict.fromkeys(map(_token_content, names))
            if c and c not in added and self._tok.token_to_id(c) is not None
        ]
        if missing:
            from tokenizers import AddedToken

            self._tok.add_special_tokens(
                [AddedToken(c, special=True, normalized=False) for c in missing]
            )

    def _added_tokens(self) -> list[tuple[int, Any]]:
        decoder = getattr(self._tok, "get_added_tokens_decoder", None)
        return list(decoder().items()) if decoder else []

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load from a directory (or its ``tokenizer.json``); EngineError if it is missing."""
        from tokenizers import Tokenizer as HfTokenizer

        p = Path(path)
        directory = p.parent if p.is_file() else p
        tj = p if p.is_file() else p / "tokenizer.json"
        if not tj.is_file():
            raise EngineError(f"{directory}: tokenizer.json is missing")
        try:
            tok = HfTokenizer.from_file(str(tj))
        except Exception as e:  # the tokenizers library raises its own Exception type
            raise EngineError(f"{tj}: cannot be read as a tokenizer ({e})") from e
        config: dict[str, Any] = {}
        tc = directory / "tokenizer_config.json"
        if tc.is_file():
            try:
                config = json.loads(tc.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise EngineError(f"{tc}: invalid JSON ({e})") from e
        return cls(tok, config, _read_chat_template(directory, config), eos_token_ids, str(tj))

    # ---- ids -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; RequestError when the tokenizer rejects it (not a string,
        a lone surrogate such as invalid UTF-8 from a command line, ...)."""
        if not isinstance(text, str):
            raise RequestError(f"the prompt must be text, got {type(text).__name__}")
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as e:  # the tokenizers library raises TypeError, its own errors
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as bad:
                raise RequestError(
                    f"the prompt is not valid Unicode text: a lone surrogate "
                    f"{text[bad.start]!r} at position {bad.start} (invalid UTF-8 bytes from a "
                    "command line or file arrive so)"
                ) from None
            raise RequestError(f"the prompt cannot be tokenized ({_short(e)})") from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------
    def _compiled_template(self) -> Any:
        if self._template is None:
            import jinja2
            import jinja2.ext

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

            def strftime_now(fmt: str) -> str:
                import datetime

                return datetime.datetime.now().strftime(fmt)

            env = _bounded_env_class()(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.max_chars = self.chat_max_chars
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            assert self.chat_template is not None
            self._template = env.from_string(self.chat_template)
        return self._template

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone with special tokens kept (a logprob entry's
        ``decoded_token``); cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 1 << 16:
                self._token_texts[token_id] = text
        return text

    def apply_chat_template(
        self,
        messages: str | list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render ``messages`` (a user string or a list of role/content dicts: system, user,
        assistant turns) with the chat template, as transformers' ``apply_chat_template``
        does (``tools`` and any other template argument passed through; the special tokens
        of tokenizer_config.json defined); token ids (no extra special tokens: the template
        has them) or the text."""
        if self.chat_template is None:
            raise RequestError(
                f"{self.source}: the engine's tokenizer has no chat template; "
                "send the prompt without --chat"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError("chat messages must be a string or a list of role/content dicts")
        context = {**self.special_tokens, **template_kwargs}
        if tools is not None:
            context["tools"] = tools
        text = self._render(
            **context, messages=messages, add_generation_prompt=add_generation_prompt
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _render(self, **context: Any) -> str:
        """The chat template rendered within ``chat_timeout_s`` seconds and
        ``chat_max_chars`` characters (a template that loops forever or produces gigabytes
        fails its request: RequestError naming the limit). The clock is read by a trace
        function on the template's own lines, so even a loop that outputs nothing stops."""
        import jinja2

        template = self._compiled_template()
        deadline = time.monotonic() + self.chat_timeout_s
        limit = f"the chat template of {self.source}"

        def check(frame: Any, event: str, arg: Any) -> Any:
            if time.monotonic() > deadline:
                raise _TemplateLimit(
                    f"{limit} ran longer than {self.chat_timeout_s:g} s (chat_timeout_s)"
                )
            return check

        def calls(frame: Any, event: str, arg: Any) -> Any:
            return check if frame.f_code.co_filename == "<template>" else None

        chunks: list[str] = []
        size = 0
        previous = sys.gettrace()
        sys.settrace(calls)
        try:
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > self.chat_max_chars:
                    raise _TemplateLimit(
                        f"{limit} produced more than {self.chat_max_chars} characters "
                        "(chat_max_chars)"
                    )
                chunks.append(chunk)
        except _TemplateLimit as e:
            raise RequestError(str(e)) from None
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"{limit} failed: {e}") from e
        except Exception as e:  # a hostile template's own error (MemoryError, RecursionError)
            raise RequestError(f"{limit} failed ({_short(e)})") from None
        finally:
            sys.settrace(previous)
        return "".join(chunks)


class _TemplateLimit(Exception):
    """A chat template ran past its time or size bound (raised inside the render)."""


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 200 else text[:197] + "..."


@functools.cache
def _bounded_env_class() -> type:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with its multiplying operators bounded: ``"x" * 10**10`` or
        ``9 ** 9 ** 9`` would allocate or compute without limit before any output."""

        intercepted_binops = frozenset({"*", "**", "%"})
        max_chars = CHAT_MAX_CHARS

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise _TemplateLimit(f"the chat template computes ** {right} (too large)")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        if len(seq) * n > self.max_chars:
                            raise _TemplateLimit(
                                f"the chat template builds more than {self.max_chars} "
                                "characters (chat_max_chars)"
                            )
            return super().call_binop(context, operator, left, right)

    return BoundedEnvironment
