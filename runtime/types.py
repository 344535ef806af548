"""Typed objects passed between Executor, Scheduler, KVCacheManager and ModelRunner.

No torch here: the scheduler side of the runtime is plain Python and testable anywhere.

Ownership:
- ``SamplingParams`` and ``Request`` come from the user (validated at construction).
- ``Sequence`` is the scheduler's mutable per-request state (tokens, block table, status).
- ``ScheduledBatch`` is what ``Scheduler.schedule()`` hands to ``ModelRunner.step()``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from llmc.base.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    Validated at construction: a bad value raises RequestError naming the field.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; the output is cut before the stop string."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the log-probability of each sampled token (and this many top alternatives)."""
    clamp_max_new_tokens: bool = False
    """If prompt + max_new_tokens exceeds max_seq_len: clamp instead of failing the request."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise bad(name, "must be in [-2, 2]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be in [0, 20]")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Any repetition / presence / frequency penalty (they need the token history)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_plain(self) -> bool:
        """Plain sampling: a row with these params needs only its constant sampling columns,
        no logprobs (their own device→host copy) and no penalties (counts of the token
        history, built on the host). The one statement of the rule behind the fast paths:
        CUDA-graph decode steps (``cuda_graphs.graph_eligible``), async scheduling
        (``engine_step.ahead_ok``) and the decode row cache (``step_inputs.DecodeRowCache``)
        serve only plain rows."""
        return self.logprobs is None and not self.uses_penalties


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens reached (or max_seq_len)
    STOP = "stop"  # EOS, a stop token id or a stop string
    CANCELLED = "cancelled"  # cancel_request()
    ERROR = "error"  # the request could not be served (message in the response)


@dataclass
class Request:
    """What a user enqueues: prompt text or token ids, sampling parameters, priority."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Higher is served first among waiting requests; arrival order within a priority."""
    streaming: bool = False
    apply_chat_template: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Sequence:
    """The scheduler's state of one request. Mutated only by Scheduler and KVCacheManager.

    Equality is identity (``eq=False``): one object per request, and ``list.remove`` on the
    running list must not compare every field of other sequences (with the generated
    ``__eq__`` a finish deep in a 1,024-row running list cost ~0.25 ms)."""

    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    """Effective limit (sampling.max_new_tokens, maybe clamped to max_seq_len): admission
    (``admission.check_new_sequence``) guarantees prompt + max_new_tokens <= max_seq_len,
    so this one number is the whole length limit (``is_last_by_length``)."""
    arrival_time: float
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (prefix hits count)."""
    block_table: list[int] = field(default_factory=list)
    block_table_version: int = 0
    """Bumped by the KVCacheManager on every change of ``block_table`` (blocks shared at
    admission, appended blocks, the free at finish or preemption). Whoever keeps a copy of
    the table (``step_inputs.DecodeRowCache``) re-reads it exactly when this changed."""
    block_table_reset_version: int = 0
    """The ``block_table_version`` at which the table last started over (admission, free).
    Between two resets the table only grows at its end, so a copy taken at a version
    ``>= block_table_reset_version`` misses only the blocks appended since."""
    num_cached_tokens: int = 0
    """Prompt tokens served from reused prefix blocks at the last admission."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    """Set when the sequence finishes, by the one who decides it: ``Scheduler.update``
    (EOS / stop token id: STOP; length: LENGTH) or a ``Scheduler.finish`` call (the
    Executor's post-processing for a stop string, which only the text shows; a cancel)."""
    stop_token_id: int | None = None
    """The EOS / stop token id that finished the sequence (``Scheduler.update``), else None.
    Its id is the last output token; its text is not part of the output text."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def is_last_by_length(self, num_output_tokens: int) -> bool:
        """Whether output token number ``num_output_tokens`` (counted from 1) is the last
        this sequence may have (finish reason LENGTH). The one statement of the length
        rule: ``max_new_tokens`` already includes the ``max_seq_len`` limit (see there).
        ``Scheduler.update`` asks it of a sampled token; async scheduling
        (``Scheduler.schedule_ahead``, ``engine_step.ahead_ok``) asks it of the token a
        step in flight is sampling (``len(output_token_ids) + 1``)."""
        return num_output_tokens >= self.max_new_tokens


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step: tokens [start, start + num_new_tokens) are computed.

    ``sample`` is True when the step ends at the last known token of the sequence (the last
    prefill chunk or a decode step), i.e. the step produces a new token for it.
    """

    seq: Sequence
    start_position: int
    num_new_tokens: int
    sample: bool

    @property
    def is_decode(self) -> bool:
        """One new token past the prompt (a re-prefill of outputs after preemption is not)."""
        return self.num_new_tokens == 1 and self.start_position >= self.seq.num_prompt_tokens

    def is_row_of(self, seq: Sequence) -> bool:
        """Whether this row belongs to ``seq`` (identity; used with ``map`` over two lists)."""
        return self.seq is seq

    def token_ids(self) -> list[int]:
        s = self.start_position
        return [self.seq.token_at(i) for i in range(s, s + self.num_new_tokens)]


@dataclass(frozen=True)
class ScheduledBatch:
    """The output of Scheduler.schedule(): what one engine step computes."""

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    preempted_request_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.sequences
