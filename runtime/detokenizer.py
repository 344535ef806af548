"""Incremental, UTF-8 safe detokenization of one request's output, with stop strings.

``IncrementalDetokenizer`` turns the output token ids of one request, as they arrive, into
text deltas. Invariants:

- The concatenation of every delta returned by ``add_tokens`` and ``finish`` is ``text``.
- A delta never ends in U+FFFD produced by a multi-byte character split across tokens: text
  whose decode ends in U+FFFD is held back until a later token completes it (or the request
  ends: ``finish`` flushes what is left, so genuinely invalid bytes still show up, once).
- Only a window of recent tokens is decoded per step (``prefix_offset`` .. end), so the cost
  per token does not grow with the output length. The window keeps the previous token in
  front, so tokenizers whose decoder strips the leading space of the first token
  (SentencePiece ``▁``) space later tokens right; the text is what ``decode`` of all output
  ids gives (a first ``▁`` token is stripped, as in transformers' ``decode``).
- Stop strings: the text is cut before the first occurrence of any stop string and the
  detokenizer reports ``stopped``. Text that might be the beginning of a stop string is held
  back until it is known not to be one, so a stop string never leaks into a delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streaming text of one request. Not thread-safe; one per request."""

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded = ""
        """Text of every output token read so far (before stop-string cutting)."""
        self._emitted = 0
        """Characters of ``_decoded`` already returned as deltas."""
        self.stopped = False
        self.stop_string: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """The text returned so far (the concatenation of all deltas)."""
        return self._decoded[: self._emitted]

    def _read(self, flush: bool) -> None:
        """Move decodable text of the window into ``_decoded``."""
        if len(self._ids) == self._read_offset:
            return
        prefix_text = self._tok.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        new_text = self._tok.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self._skip
        )
        if not flush and new_text.endswith(REPLACEMENT_CHAR):
            return  # an incomplete multi-byte character: wait for the next token
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text) :]
        else:  # decoding is not prefix-stable here; keep the common prefix only
            i = 0
            while i < min(len(prefix_text), len(new_text)) and prefix_text[i] == new_text[i]:
                i += 1
            delta = new_text[i:]
        self._decoded += delta
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        """Return the next delta, applying stop strings (cut + hold back possible prefixes)."""
        if self._stop:
            start = self._emitted  # held-back text guarantees no stop string starts earlier
            hits = [(i, s) for s in self._stop if (i := self._decoded.find(s, start)) != -1]
            if hits:
                cut, s = min(hits)
                self._decoded = self._decoded[:cut]
                self.stopped, self.stop_string = True, s
                final = True
            if not final:
                hold = 0
                for s in self._stop:  # longest suffix of the text that begins a stop string
                    for k in range(min(len(s) - 1, len(self._decoded) - self._emitted), hold, -1):
                        if self._decoded.endswith(s[:k]):
                            hold = k
                            break
                limit = len(self._decoded) - hold
                delta = self._decoded[self._emitted : limit]
                self._emitted = limit
                return delta
        delta = self._decoded[self._emitted :]
        self._emitted = len(self._decoded)
        return delta

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated token ids; return the text delta that is now safe to show."""
        if self.stopped or self.finished:
            return ""
        self._ids.extend(token_ids)
        self._read(flush=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: flush held-back text and return the last delta."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        self._read(flush=True)
        return self._release(final=True)
