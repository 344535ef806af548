"""What the Executor hands back: streamed ``Response`` objects and ``RequestOutput`` results.

No torch here. ``ExecutorParts`` bundles the components an Executor drives when they are not
built by ``EngineRuntime`` (tests, a runtime driven from an in-memory checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmc.runtime.records import RequestRecord, e2e, tpot, ttft
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
    """One output of a request (vLLM's and TensorRT-LLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Any] | None
    finish_reason: FinishReason | None


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
    entry None, then each token's ``PromptLogprob`` (logprob, rank, top-k {id: logprob})."""

    @property
    def ok(self) -> bool:
        return self.error is None

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
