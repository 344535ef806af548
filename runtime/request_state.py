"""RequestState: the Executor's view of one request's output stream (no torch).

It turns the tokens the scheduler appended to a ``Sequence`` into ``Response`` objects:
new token ids since the last step, their text delta (``IncrementalDetokenizer``), the
request's ``RequestRecord`` timings, and the final response.

A request with several outputs (``SamplingParams.num_branches > 1``) has one state per
sequence (``outputs``, by branch; ``outputs[0]`` is the request's own state): each turns its
sequence's tokens into its stream (``Response.index``) and, when its sequence finishes, into
its ``CompletionOutput``; the request's final Response comes when every output is done
(``completions``: the n outputs, best first for best_of > n; beams: the n best finished
beams, built from the group at the end, as beams are not streamed).

Invariants: ``final`` flips once, when the final Response is built; for a streaming request
the concatenated ``new_token_ids``/``new_text`` of its responses of one ``index`` equal that
output's final ``token_ids``/``text``; a non-streaming request's only response carries
everything. The text of a finishing EOS / stop token id is not part of the output text (its
id is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.records import RequestRecord
from llmc.runtime.responses import CompletionOutput, Response
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
    tokenizer: Any = None
    """The engine's tokenizer (None without one): other outputs' detokenizers."""
    outputs: list[RequestState] | None = None
    """A request with several outputs: the state of each sequence, by branch (``[0]`` is
    this one); None for a plain request."""
    main: RequestState | None = None
    """Another output's state: the request's own (``outputs[0]``)."""
    index: int = 0
    done: bool = False
    """This output's sequence finished (its ``completion`` is made)."""
    cumulative_logprob: float | None = None
    """Summed logprob of this output's tokens, when each token's is computed."""
    completion: CompletionOutput | None = None
    run: Any = None
    """``(TokenRuns, slot)`` while token times of this output are held in a run
    (runtime/token_runs.py): ``settle`` writes them before they are read."""

    def __post_init__(self) -> None:
        if self.main is None and self.request.sampling.num_branches > 1:
            self.outputs = [self]  # the others join as the fork makes their sequences

    def settle(self) -> None:
        """Write the token times (and ``num_seen``) a run holds for this output."""
        if self.run is not None:
            self.run[0].settle(self)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def take_new_tokens(self, logprob: Any, now: float) -> tuple[list[int], list[Any]]:
        """Output tokens (and their logprobs) appended since the last call; records timings."""
        assert self.seq is not None
        if self.run is not None:
            self.run[0].settle(self)
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
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprob.logprob
            if self.request.sampling.logprobs is None:  # computed to rank best_of samples
                return new, []
            self.logprobs.append(logprob)
            return new, [logprob]
        return new, []

    def output(self, seq: Sequence) -> RequestState:
        """The state of ``seq``'s output (this one for a plain request or branch 0)."""
        outs = self.outputs
        if outs is None or seq.branch == 0:
            return self
        while len(outs) <= seq.branch:
            outs.append(self._new_output(len(outs)))
        return outs[seq.branch]

    def _new_output(self, index: int) -> RequestState:
        assert self.seq is not None and self.seq.group is not None
        seq = self.seq.group.branches[index]
        tok = self.tokenizer
        return RequestState(
            request=self.request,
            record=RequestRecord(
                request_id=self.record.request_id,
                arrival_time=0.0,
                num_prompt_tokens=self.record.num_prompt_tokens,
            ),  # fmt: skip
            seq=seq,
            detok=None if tok is None else IncrementalDetokenizer(tok, self.request.sampling.stop),
            deferred=self.deferred,
            main=self,
            index=index,
        )

    def finish(
        self, reason: FinishReason, new: list[int], delta: str, new_lp: list[Any], now: float
    ) -> list[Response]:
        """This output's sequence finished: the Responses that says (a plain request's final
        one; for an output of several, its last delta when streaming, then the request's
        final Response once every output is done)."""
        main = self.main or self
        if main.outputs is None:
            return [self.final_response(reason, new, delta, new_lp, now)]
        delta += self._close_output(reason)
        out = []
        if self.request.streaming and (new or delta):
            out.append(self.delta_response(new, delta, new_lp))
        if main.all_done():
            out.append(main.outputs_response(now))
        return out

    def _close_output(self, reason: FinishReason) -> str:
        """Make this output's CompletionOutput (its text finished); returns the text delta
        the detokenizer still held."""
        self._catch_up()
        delta = self.detok.finish() if self.detok is not None else ""
        assert self.seq is not None
        self.done = True
        self.completion = CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.seq.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.request.sampling.logprobs is not None else None,
            finish_reason=reason,
        )
        return delta

    def close(self, reason: FinishReason, now: float) -> Response:
        """The request ends now, for ``reason`` (a cancel): its final Response, every output
        not done closed with ``reason``."""
        self.settle()
        if self.outputs is None:
            return self.final_response(reason, [], "", [], now)
        if self.seq is not None and self.seq.group.beam:
            return self.beam_response(now, reason)
        for o in self.outputs:
            if not o.done:
                o._close_output(reason)
        return self.outputs_response(now, reason)

    def outputs_response(self, now: float, reason: FinishReason | None = None) -> Response:
        """The final Response of a request with several samples: its ``n`` outputs (the
        ``n`` of highest cumulative logprob, renumbered best first, for best_of > n)."""
        sp = self.request.sampling
        done = [o.completion for o in self.outputs or [self] if o.completion is not None]
        if sp.ranks_by_logprob:
            done.sort(
                key=lambda c: -math.inf if c.cumulative_logprob is None else -c.cumulative_logprob
            )
            done = [dataclasses.replace(c, index=i) for i, c in enumerate(done[: sp.n])]
        return self._outputs_final(done[: sp.n], now, reason, streamed=self.request.streaming)

    def beam_response(self, now: float, reason: FinishReason | None = None) -> Response:
        """The final Response of a beam search: the ``n`` best finished beams (a search
        cancelled before any finished: its running beams), each detokenized whole."""
        assert self.seq is not None
        g, n = self.seq.group, self.request.sampling.n
        hyps = [(h.token_ids, h.cumulative_logprob, h.finish_reason) for h in g.finished[:n]]
        if not hyps:  # cancelled early: what the running beams hold
            scores = g.beam_scores or [0.0] * len(g.branches)
            hyps = [(tuple(b.output_token_ids), sc, reason or FinishReason.CANCELLED)
                    for b, sc in zip(g.branches, scores, strict=False)][:n]  # fmt: skip
        outs = []
        for i, (ids, cum, why) in enumerate(hyps):
            stop = why is FinishReason.STOP and ids and ids[-1] in g.stop_ids
            text = self._decode(list(ids[:-1] if stop else ids))
            outs.append(CompletionOutput(i, text, list(ids), cum, None, why))
        return self._outputs_final(outs, now, reason, streamed=False)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        detok = IncrementalDetokenizer(self.tokenizer, ())
        return detok.add_tokens(ids) + detok.finish()

    def _outputs_final(
        self,
        outs: list[CompletionOutput],
        now: float,
        reason: FinishReason | None,
        *,
        streamed: bool,
    ) -> Response:
        """Close the request with its outputs ``outs`` (output 0 first) and build its one
        final Response (``completions``; ``token_ids`` / ``text`` are output 0's)."""
        assert self.seq is not None and not self.final
        first = outs[0] if outs else CompletionOutput(0, "", [], None, None, reason)
        reason = reason or first.finish_reason or FinishReason.STOP
        rec = self.record
        rec.finish_time, rec.finish_reason = now, reason.value
        rec.num_output_tokens = sum(len(c.token_ids) for c in outs)
        rec.num_cached_tokens = self.seq.num_cached_tokens
        rec.num_preemptions = max(b.num_preemptions for b in self.seq.group.branches)
        self.final = True
        return Response(
            request_id=self.seq.request_id,
            new_token_ids=[] if streamed else list(first.token_ids),
            new_text="" if streamed else first.text,
            is_final=True,
            finish_reason=reason,
            logprobs=None if streamed else first.logprobs,
            token_ids=list(first.token_ids),
            text=first.text,
            prompt_logprobs=self._prompt_logprobs_out(),
            cumulative_logprob=first.cumulative_logprob,
            completions=outs,
        )

    def all_done(self) -> bool:
        """Every output of this request finished (all forked: ``num_branches`` of them)."""
        outs = self.outputs or [self]
        g = self.seq.group if self.seq is not None else None
        forked = g is None or g.forked
        return forked and all(o.done for o in outs) and len(outs) == len(g.branches if g else outs)

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
    def has_stop_strings(self) -> bool:
        return self.detok is not None and bool(self.request.sampling.stop)

    @property
    def stopped_by_string(self) -> bool:
        return self.detok is not None and self.detok.stopped

    def delta_response(self, new: list[int], delta: str, new_lp: list[Any]) -> Response:
        assert self.seq is not None
        return Response(self.seq.request_id, new, delta, logprobs=new_lp or None, index=self.index)

    def final_response(
        self, reason: FinishReason, new: list[int], delta: str, new_lp: list[Any], now: float
    ) -> Response:
        """Close the request (flush the detokenizer, fill the record) and build its last
        response."""
        seq = self.seq
        assert seq is not None and not self.final
        self.settle()
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
            cumulative_logprob=self.cumulative_logprob,
        )

    def error_response(self, error: BaseException) -> Response:
        """Close the request with an error (its message, prefixed once with ``request N:``,
        and its error class's exit code). The text so far is kept where it can be made (the
        detokenizer may be what failed)."""
        self.settle()
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


def _rank(c: CompletionOutput) -> float:
    """Sort key of a best_of sample: highest cumulative logprob first (unknown last)."""
    return math.inf if c.cumulative_logprob is None else -c.cumulative_logprob
