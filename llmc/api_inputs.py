"""What ``LLM`` is given, made plain: the ``model`` path (an engine directory, an HF
checkpoint directory or a .gguf file), the checkpoint arguments, and the prompts of
``generate`` / ``chat``.

Invariants: every refusal is a ConfigError (a ``ValueError``) or a RequestError naming what
was passed and what is expected; nothing here loads an engine or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from llmc.base.errors import ConfigError, EngineError, RequestError
from llmc.compiler.build_config import BuildConfig
from llmc.runtime.chat_messages import check_conversation, is_conversation
from llmc.runtime.types import Request, SamplingParams

Prompt = str | Sequence[int]


def resolve_model(model: str | Path) -> tuple[Path | None, Path | None]:
    """(engine_dir, checkpoint) of a ``model`` path: a directory with config.json and no
    manifest.json is an HF checkpoint, any other directory an engine (loaded as is; a
    damaged one is refused naming what it lacks); a .gguf file (or a file starting with the
    GGUF magic) is a GGUF checkpoint. Checkpoints are built into the engine cache."""
    if not isinstance(model, (str, Path)):
        raise ConfigError(f"model must be a path, got {type(model).__name__}")
    path = Path(model).expanduser()
    if not path.exists():  # EngineError: what LLM(path) said before ``model`` existed
        raise EngineError(
            f"model={str(model)!r} does not exist: give a local engine directory, HF checkpoint "
            "directory or .gguf file (llmc downloads no models from a hub)"
        )
    if path.is_dir():
        if (path / "config.json").is_file() and not (path / "manifest.json").is_file():
            return None, path
        return path, None  # an engine (load_engine names what a damaged one lacks)
    if path.suffix.lower() == ".gguf" or _gguf_magic(path):
        return None, path
    raise ConfigError(
        f"model={str(model)!r} is a file but not a .gguf checkpoint: give an engine "
        "directory (with manifest.json), an HF checkpoint directory (with config.json) or a "
        ".gguf file"
    )


def _gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def checkpoint_arg(
    engine_dir: str | Path | None,
    checkpoint_dir: str | Path | None,
    build_config: BuildConfig | None,
) -> str | Path | None:
    """The checkpoint to build on the fly (None: ``engine_dir`` is loaded as is), after the
    consistency checks of ``LLM``'s arguments."""
    if build_config is not None and not isinstance(build_config, BuildConfig):
        raise ConfigError(
            f"build_config must be a llmc.BuildConfig, got {type(build_config).__name__}"
        )
    from_config = build_config.checkpoint_dir if build_config is not None else None
    if checkpoint_dir is not None and from_config is not None:
        if Path(checkpoint_dir).resolve() != Path(from_config).resolve():
            raise ConfigError(
                f"checkpoint_dir={str(checkpoint_dir)!r} and build_config.checkpoint_dir="
                f"{from_config!r} differ; give the checkpoint once"
            )
    checkpoint = checkpoint_dir if checkpoint_dir is not None else from_config
    if engine_dir is not None and (checkpoint is not None or build_config is not None):
        raise ConfigError(
            f"engine_dir={str(engine_dir)!r} is already built; checkpoint_dir and "
            "build_config are for building on the fly — pass one or the other"
        )
    if engine_dir is None and checkpoint is None:
        raise ConfigError(
            "LLM needs model (an engine directory, HF checkpoint directory or .gguf file), "
            "engine_dir (an engine built by llmc build) or checkpoint_dir (an HF checkpoint "
            "directory or .gguf file to build on the fly)"
        )
    return checkpoint


VLLM_PROMPT_KEYS = ("prompt", "prompt_token_ids")
"""vLLM's ``TextPrompt`` / ``TokensPrompt`` dicts: one of these keys."""


def prompt_list(prompts: Any, chat: bool = False) -> list[Any]:
    """``generate``'s prompts as a list: one string, one token-id list (a list of ints) or
    a list of those. A chat conversation (a list of {role, content} dicts) is refused,
    naming what was passed and where conversations go, unless ``chat`` (the chat template
    is applied: one conversation, or a list of them, are prompts then)."""
    if is_conversation(prompts) and not set(VLLM_PROMPT_KEYS) & set(prompts[0]):
        if chat:
            return [prompts]
        check_conversation(prompts, False, "the prompt")
    single = (
        isinstance(prompts, (str, bytes, dict))
        or not isinstance(prompts, Iterable)  # not a prompt: Request names it
        or (isinstance(prompts, (list, tuple)) and bool(prompts) and _is_int(prompts[0]))
    )
    return [prompts] if single else list(prompts)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) or type(x).__name__.startswith(("int", "uint"))  # numpy ints


def conversation_list(messages: Any) -> list[list[dict[str, Any]]]:
    """``chat``'s argument as a list of conversations: one conversation (a list of message
    dicts) or a list of them."""
    if is_conversation(messages):
        return [messages]
    if isinstance(messages, (list, tuple)) and messages and all(map(is_conversation, messages)):
        return list(messages)
    raise RequestError(
        f"LLM.chat takes a conversation (a list of {{role, content}} dicts) or a list of "
        f"conversations, got {_described(messages)}"
    )


def _described(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} ({', '.join(kinds) or 'nothing'})"
    return type(value).__name__


def sampling_list(sampling_params: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: one for all (None: the defaults) or one each."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ConfigError(
            f"{len(params)} sampling_params for {n} prompts: give one SamplingParams, or one "
            "per prompt"
        )
    return params


def _vllm_prompt(prompt: dict[str, Any]) -> Any:
    """The text or token ids of a vLLM prompt dict (``{"prompt": text}`` or
    ``{"prompt_token_ids": ids}``); any other dict is refused (a chat message is the usual
    mistake, named)."""
    keys = [k for k in VLLM_PROMPT_KEYS if k in prompt]
    if len(keys) == 1 and len(prompt) == 1:
        return prompt[keys[0]]
    if "role" in prompt:
        raise RequestError(
            "the prompt is one chat message (a dict with a role), not a prompt: a prompt is a "
            "string or a list of token ids; send conversations (lists of such dicts) through "
            "LLM.chat"
        )
    raise RequestError(
        f"a prompt dict has exactly one of the keys {', '.join(VLLM_PROMPT_KEYS)}, got "
        f"{sorted(map(str, prompt))[:8]}"
    )


def make_request(
    prompt: Any, sampling: SamplingParams, priority: int, chat: bool, streaming: bool
) -> Request:
    """A Request for ``prompt`` (text, token ids, or a vLLM prompt dict of either); its
    fields are checked by ``Request.validate`` (RequestError naming the field), the one home
    of those rules."""
    if isinstance(prompt, dict):
        prompt = _vllm_prompt(prompt)
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)) or is_conversation(prompt):
        return Request(
            prompt=prompt,  # type: ignore[arg-type]
            sampling=sampling,
            priority=priority,
            streaming=streaming,
            apply_chat_template=chat,
        )
    return Request(
        prompt_token_ids=list(prompt), sampling=sampling, priority=priority, streaming=streaming
    )
