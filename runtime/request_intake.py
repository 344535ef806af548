"""What the Executor does to a request before it takes its lock (no torch, no state).

- ``prompt_ids``: a Request checked (``Request.validate``, then what needs the engine: the
  vocabulary, a tokenizer) and its prompt as token ids (text encoded, a chat template
  rendered). Every refusal, a prompt the tokenizer rejects included, is a RequestError.
- ``requests_for``: ``Executor.generate``'s arguments (one prompt or several, as text, token
  ids or Requests; one SamplingParams or one per prompt) as Requests.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from llmc.base.errors import RequestError
from llmc.runtime.types import Request, SamplingParams


def check_vocab(what: str, ids: Seq[int], vocab_size: int) -> None:
    """RequestError naming the first of ``ids`` outside [0, vocab_size)."""
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):  # C-level passes
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{what} {bad[0]!r} is outside the vocabulary [0, {vocab_size})")


def prompt_ids(request: Request, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt of ``request`` as token ids, the request checked first (see the module
    docstring); ``tokenizer``: the engine's, or None."""
    request.validate()
    sp = request.sampling
    if sp.stop and tokenizer is None:
        raise RequestError("stop strings need a tokenizer; the engine has none")
    check_vocab("stop_token_ids", sp.stop_token_ids, vocab_size)
    check_vocab("logit_bias token id", [t for t, _ in sp.logit_bias], vocab_size)
    if request.prompt is not None:
        if tokenizer is None:
            raise RequestError("the engine has no tokenizer; send prompt_token_ids")
        if request.apply_chat_template:
            kwargs = request.chat_template_kwargs or {}
            ids = list(tokenizer.apply_chat_template(request.prompt, **kwargs))
        else:
            ids = tokenizer.encode(request.prompt)
    elif request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
        check_vocab("prompt token id", ids, vocab_size)
    else:
        ids = []
    if not ids:
        raise RequestError("the prompt is empty")
    return ids


def requests_for(
    prompts: Any, sampling: SamplingParams | Seq[SamplingParams] | None, apply_chat_template: bool
) -> tuple[list[Any], list[Request]]:
    """(the prompts as a list, one Request per prompt) of ``Executor.generate``'s arguments;
    a count of sampling params that differs from the prompts' is a RequestError."""
    if isinstance(prompts, (str, Request)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or SamplingParams()] * len(prompts)
    else:
        params = list(sampling)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
    requests: list[Request] = []
    for p, sp in zip(prompts, params, strict=True):
        if isinstance(p, Request):
            requests.append(p)
        elif isinstance(p, str):
            requests.append(Request(prompt=p, sampling=sp, apply_chat_template=apply_chat_template))
        else:
            requests.append(Request(prompt_token_ids=list(p), sampling=sp))
    return prompts, requests
