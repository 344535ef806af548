"""What the Executor hands back: streamed ``Response`` objects and ``RequestOutput`` results.

``RequestOutput`` has llmc's own attributes (``text``, ``token_ids``, ``timings`` ...) and
the shape vLLM and TensorRT-LLM users read: ``outputs`` (a list of ``CompletionOutput``),
``prompt``, ``prompt_token_ids``, ``prompt_logprobs``, ``metrics``, ``finished``; the
mapping of names is docs/PYTHON_API.md. No torch here. ``ExecutorParts`` bundles the
components an Executor drives when they are not built by ``EngineRuntime`` (tests, a runtime
driven from an in-memory checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmc.runtime.logprobs import with_texts
from llmc.runtime.records import RequestRecord, e2e, last_token_time, tpot, ttft
from llmc.runtime.types import FinishReason


@dataclass
class Response:
    """One message about one request.

    Streaming requests get one per step that produced tokens or text; every request gets
    exactly one final one (``is_final``), which also carries the whole output
    (``token_ids``, ``text``). ``logprobs`` holds one entry per token of ``new_token_ids``
    (``llmc.runtime.sampling.TokenLogprobs``) when the request asked for them.
    ``finish_reason`` is the sequence's, as the Scheduler recorded it (``Scheduler.update``
    for EOS / stop token ids / length, ``Scheduler.finish`` for stop strings and cancels).
    """

    request_id: int
    new_token_ids: list[int]
    new_text: str
    is_final: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: int | None = None
    """The exit code of the error's llmc.base.errors class (RequestError: 8)."""
    logprobs: list[Any] | None = None
    token_ids: list[int] | None = None
    """Final response only: every output token id."""
    text: str | None = None
    """Final response only: the whole output text."""
    prompt_logprobs: list[Any] | None = None
    """Final response only, when the request asked for ``prompt_logprobs``: one entry per
    prompt token (``llmc.runtime.prompt_logprobs.PromptLogprob``; None for the first)."""
    index: int = 0
    """Which output of the request the tokens of a streamed response belong to (0 .. n-1:
    ``SamplingParams.n`` samples or returned beams). A request has exactly one final
    response, sent when every output has finished."""
    cumulative_logprob: float | None = None
    """Final response: output 0's summed token log-probability (beam search: its beam score
    before the length penalty), when known."""
    completions: list[CompletionOutput] | None = None
    """Final response of a request with several outputs: all of them, by ``index``
    (``token_ids`` / ``text`` / ``finish_reason`` / ``logprobs`` above are output 0's).
    None for a request with one output."""


@dataclass
class CompletionOutput:
    """One output of a request (vLLM's and TensorRT-LLM's ``CompletionOutput``).

    ``logprobs``: one entry per token of ``token_ids`` (``llmc.runtime.logprobs``: llmc's
    ``TokenLogprobs`` and vLLM's ``dict[int, Logprob]`` in one object) when asked for.
    ``finish_reason`` is a ``FinishReason``, a ``str`` enum: it equals ``"stop"``,
    ``"length"`` ... as vLLM's strings do."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Any] | None
    finish_reason: FinishReason | None

    def finished(self) -> bool:
        return self.finish_reason is not None


def summed_logprob(entries: list[Any] | None) -> float | None:
    """``cumulative_logprob`` of one output: the sum of its tokens' logprobs (None when the
    request asked for none)."""
    return None if not entries else float(sum(e.logprob for e in entries))


@dataclass(frozen=True)
class RequestMetrics:
    """vLLM's ``RequestMetrics`` from the request's record: times in ``time.perf_counter``
    seconds (None: not reached), and the time spent waiting for the first step."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    time_in_queue: float | None
    num_cached_tokens: int


@dataclass(frozen=True)
class RequestTimings:
    """Latencies of one request in seconds, from the executor's RequestRecord (None: no data)."""

    queue_s: float | None
    """Arrival to the first step that computed any of its tokens."""
    ttft_s: float | None
    """Time to first token: arrival to first output token (queueing and prefill included)."""
    tpot_s: float | None
    """Mean gap between output tokens after the first (None with one output token)."""
    e2e_s: float | None
    """Arrival to finish."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from reused prefix KV blocks."""


@dataclass
class RequestOutput:
    """The result of one request of ``Executor.generate`` / ``LLM.generate`` (exported as
    ``llmc.GenerationOutput`` too): text, token ids, finish reason, error, logprobs and
    prompt logprobs when asked for, the timing record and its ``timings``."""

    request_id: int
    prompt: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    error: str | None
    error_code: int | None
    logprobs: list[Any] | None
    record: RequestRecord
    prompt_logprobs: list[Any] | None = None
    """With ``SamplingParams.prompt_logprobs``: aligned with ``prompt_token_ids``, the first
    entry None, then each token's ``PromptLogprob`` (logprob, rank, top-k {id: logprob}; also
    vLLM's ``dict[int, Logprob]``)."""
    cumulative_logprob: float | None = None
    """Output 0's summed token logprob: the final Response's, else the sum of ``logprobs``."""
    completions: list[CompletionOutput] | None = None
    """Every output of a request with several (``SamplingParams.n``, beams), from the final
    Response; None for one output (``outputs`` then builds it from the fields above)."""

    def __post_init__(self) -> None:
        if self.cumulative_logprob is None:
            self.cumulative_logprob = summed_logprob(self.logprobs)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def finished(self) -> bool:
        """vLLM's ``finished``: the request is over (it is, for ``generate``'s outputs)."""
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's and TensorRT-LLM's ``outputs``: one ``CompletionOutput`` per output, by
        index (``outputs[0]`` carries ``text``, ``token_ids``, ``logprobs`` above)."""
        if self.completions:
            return list(self.completions)
        return [
            CompletionOutput(
                index=0,
                text=self.text,
                token_ids=self.token_ids,
                cumulative_logprob=self.cumulative_logprob,
                logprobs=self.logprobs,
                finish_reason=self.finish_reason,
            )
        ]

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's: prompt tokens served from reused prefix KV blocks."""
        return self.record.num_cached_tokens

    @property
    def metrics(self) -> RequestMetrics:
        r = self.record
        return RequestMetrics(
            arrival_time=r.arrival_time,
            first_scheduled_time=r.scheduled_time,
            first_token_time=r.first_token_time,
            last_token_time=last_token_time(r),
            finished_time=r.finish_time,
            time_in_queue=None if r.scheduled_time is None else r.scheduled_time - r.arrival_time,
            num_cached_tokens=r.num_cached_tokens,
        )

    def attach_token_texts(self, token_text: Callable[[int], str]) -> RequestOutput:
        """Attach each logprob entry's token texts (``Logprob.decoded_token``): generated
        tokens', prompt tokens' and every completion's. Returns this output."""
        self.logprobs = with_texts(self.logprobs, token_text)
        self.prompt_logprobs = with_texts(self.prompt_logprobs, token_text)
        for c in self.completions or ():
            c.logprobs = with_texts(c.logprobs, token_text)
        return self

    @property
    def timings(self) -> RequestTimings:
        r = self.record
        return RequestTimings(
            queue_s=None if r.scheduled_time is None else r.scheduled_time - r.arrival_time,
            ttft_s=ttft(r),
            tpot_s=tpot(r),
            e2e_s=e2e(r),
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens,
        )


@dataclass
class ExecutorParts:
    """Components for an Executor built by hand: ``runner.step(batch)`` → an object with
    ``token_ids`` (one per sampled sequence, batch order), ``logprobs`` and ``phase_times``."""

    runner: Any
    scheduler: Any
    vocab_size: int
    tokenizer: Any = None
