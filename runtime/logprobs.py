"""Log-probability entries of tokens, in llmc's shape and in vLLM's (no torch).

One entry per position: ``TokenLogprobs`` for a generated token (``llmc.runtime.sampling``
fills it from the sampler's logits), ``PromptLogprob`` for a prompt token
(``llmc.runtime.prompt_logprobs``). Each keeps llmc's attributes (``token_id``, ``logprob``,
``rank``, ``top``) and is also a read-only mapping token id → ``Logprob(logprob, rank,
decoded_token)``: the chosen token first, then the top alternatives (most likely first), as
vLLM's per-position ``dict[int, Logprob]``.

Invariants: entries are frozen; ``decoded_token`` is None until ``with_texts`` attached the
texts (each id decoded alone, special tokens kept: ``Tokenizer.token_text``), which the front
door does for what it returns, off the engine loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: one token's log-probability at a position, its rank there (1 =
    the most likely; None when unknown) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(Mapping[int, Logprob]):
    """The mapping view of one position's entry (a mixin of the frozen entry dataclasses,
    which provide ``token_id``, ``logprob``, ``rank``, ``texts`` and ``top_items``)."""

    token_id: int
    logprob: float
    rank: int | None
    texts: Mapping[int, str] | None

    def top_items(self) -> Iterable[tuple[int, float]]:
        raise NotImplementedError

    def _text(self, token_id: int) -> str | None:
        return None if self.texts is None else self.texts.get(token_id)

    def __getitem__(self, token_id: int) -> Logprob:
        if token_id == self.token_id:
            return Logprob(self.logprob, self.rank, self._text(token_id))
        for j, (i, lp) in enumerate(self.top_items()):
            if i == token_id:
                return Logprob(lp, j + 1, self._text(i))
        raise KeyError(token_id)

    def __iter__(self) -> Iterator[int]:
        yield self.token_id
        for i, _ in self.top_items():
            if i != self.token_id:
                yield i

    def __len__(self) -> int:
        return 1 + sum(i != self.token_id for i, _ in self.top_items())

    def with_texts(self, token_text: Callable[[int], str]) -> Any:
        """This entry with every id's text (``decoded_token``) attached."""
        return dataclasses.replace(self, texts={i: token_text(i) for i in self})


@dataclass(frozen=True)
class TokenLogprobs(PositionLogprobs):
    """A generated token: its log-probability, its rank among the vocabulary (vLLM's: the
    number of tokens at least as likely) and the ``len(top)`` most likely (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
    texts: Mapping[int, str] | None = field(default=None, compare=False, repr=False)

    def top_items(self) -> Iterable[tuple[int, float]]:
        return self.top


@dataclass(frozen=True)
class PromptLogprob(PositionLogprobs):
    """One prompt token's entry: its logprob given the tokens before it, its rank (1 = the
    most likely token) and the ``k`` most likely ids with their logprobs (most likely first)."""

    token_id: int
    logprob: float
    rank: int
    top: Mapping[int, float] = field(default_factory=dict)
    texts: Mapping[int, str] | None = field(default=None, compare=False, repr=False)

    def top_items(self) -> Iterable[tuple[int, float]]:
        return self.top.items()


def with_texts(entries: list[Any] | None, token_text: Callable[[int], str]) -> list[Any] | None:
    """``entries`` (None entries kept: a prompt's first token) with their texts attached."""
    if entries is None:
        return None
    return [e if e is None else e.with_texts(token_text) for e in entries]


def entry_json(entry: Any) -> dict[str, Any] | None:
    """One position's entry as plain JSON (``llmc run --json``): the token's id, text,
    logprob and rank, and its top alternatives (id, text, logprob), most likely first."""
    if entry is None:
        return None
    return {
        "token_id": entry.token_id,
        "token": entry._text(entry.token_id),
        "logprob": entry.logprob,
        "rank": entry.rank,
        "top": [
            {"token_id": i, "token": entry._text(i), "logprob": lp} for i, lp in entry.top_items()
        ],
    }
