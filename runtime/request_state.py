"""RequestState: the Executor's view of one request's output stream (no torch).

It turns the tokens the scheduler appended to a ``Sequence`` into ``Response`` objects:
new token ids since the last step, their text delta (``IncrementalDetokenizer``), the
request's ``RequestRecord`` timings, and the final response.

Invariants: ``final`` flips once, when the final Response is built; for a streaming request
the concatenated ``new_token_ids``/``new_text`` of its responses equal the final
``token_ids``/``text``; a non-streaming request's only response carries everything. The
text of a finishing EOS / stop token id is not part of the output text (its id is).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.records import RequestRecord
from llmc.runtime.responses import Response
from llmc.runtime.types import FinishReason, Request, Sequence


@dataclass
class RequestState:
    request: Request
    record: RequestRecord
    seq: Sequence | None = None
    detok: IncrementalDetokenizer | None = None
    num_seen: int = 0
    """Output tokens of ``seq`` already turned into responses."""
    logprobs: list[Any] = field(default_factory=list)
    final: bool = False
    deferred: bool = False
    """Text is made once, at the end (a non-streaming request without stop strings: nobody
    sees a delta, so per-step detokenization would be wasted host time)."""
    num_text: int = 0
    """Output tokens of ``seq`` already fed to the detokenizer."""
    prompt_logprobs: list[Any] | None = None
    """With ``prompt_logprobs``: one entry per prompt token as the steps compute them."""

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def take_new_tokens(self, logprob: Any, now: float) -> tuple[list[int], list[Any]]:
        """Output tokens (and their logprobs) appended since the last call; records timings."""
        assert self.seq is not None
        out = self.seq.output_token_ids
        n = len(out) - self.num_seen
        if n == 1:  # the common case: one token per step, no extra lists
            new = [out[-1]]
            self.record.token_times.append(now)
        else:
            new = out[self.num_seen :]
            self.record.token_times.extend([now] * n)
        self.num_seen = len(out)
        rec = self.record
        if new and rec.first_token_time is None:
            rec.first_token_time = now
        if logprob is not None and new:
            self.logprobs.append(logprob)
            return new, [logprob]
        return new, []

    def add_prompt_logprobs(self, first: int, entries: tuple[Any, ...]) -> None:
        """Entries of prompt tokens ``first, first + 1, ...`` (a recomputed one replaces)."""
        assert self.seq is not None
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.seq.prompt_token_ids)
        self.prompt_logprobs[first : first + len(entries)] = entries

    def _prompt_logprobs_out(self) -> list[Any] | None:
        if self.request.sampling.prompt_logprobs is None or self.seq is None:
            return None
        if self.prompt_logprobs is None:  # a one-token prompt scores nothing
            return [None] * len(self.seq.prompt_token_ids)
        return list(self.prompt_logprobs)

    def detokenize(self, token_ids: list[int]) -> str:
        """Text delta of ``token_ids`` ('' without a tokenizer); see ``stopped_by_string``."""
        self.num_text += len(token_ids)
        return self.detok.add_tokens(token_ids) if self.detok is not None else ""

    def _catch_up(self) -> None:
        """A deferred request ends: its not yet detokenized outputs get their text."""
        if self.deferred and self.seq is not None:
            rest = self.seq.output_token_ids[self.num_text :]
            if rest:
                self.detokenize(rest)

    @property
    def stopped_by_string(self) -> bool:
        return self.detok is not None and self.detok.stopped

    def delta_response(self, new: list[int], delta: str, new_lp: list[Any]) -> Response:
        assert self.seq is not None
        return Response(self.seq.request_id, new, delta, logprobs=new_lp or None)

    def final_response(
        self, reason: FinishReason, new: list[int], delta: str, new_lp: list[Any], now: float
    ) -> Response:
        """Close the request (flush the detokenizer, fill the record) and build its last
        response."""
        seq = self.seq
        assert seq is not None and not self.final
        self._catch_up()
        if self.detok is not None:
            delta += self.detok.finish()
        ids = list(seq.output_token_ids)
        rec = self.record
        rec.finish_time, rec.finish_reason = now, reason.value
        rec.num_output_tokens = len(ids)
        rec.num_cached_tokens = seq.num_cached_tokens
        rec.num_preemptions = seq.num_preemptions
        self.final = True
        streaming = self.request.streaming
        return Response(
            request_id=seq.request_id,
            new_token_ids=new if streaming else ids,
            new_text=delta if streaming else self.text,
            is_final=True,
            finish_reason=reason,
            logprobs=(new_lp if streaming else self.logprobs) or None,
            token_ids=ids,
            text=self.text,
            prompt_logprobs=self._prompt_logprobs_out(),
        )

    def error_response(self, error: BaseException) -> Response:
        """Close the request with an error (its message, prefixed once with ``request N:``,
        and its error class's exit code). The text so far is kept where it can be made (the
        detokenizer may be what failed)."""
        with contextlib.suppress(Exception):  # best effort: the error is what is reported
            self._catch_up()
        rec = self.record
        prefix = f"request {rec.request_id}: "
        message = str(error) if str(error).startswith(prefix) else prefix + str(error)
        rec.error, rec.finish_reason = message, FinishReason.ERROR.value
        rec.finish_time = time.perf_counter()
        ids = list(self.seq.output_token_ids) if self.seq is not None else []
        rec.num_output_tokens = len(ids)
        self.final = True
        streaming = self.request.streaming
        return Response(
            request_id=rec.request_id,
            new_token_ids=[] if streaming else ids,
            new_text="" if streaming else self.text,
            is_final=True,
            finish_reason=FinishReason.ERROR,
            error=message,
            error_code=getattr(error, "exit_code", 1),
            token_ids=ids,
            text=self.text,
        )
