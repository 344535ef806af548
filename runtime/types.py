"""Typed objects passed between Executor, Scheduler, KVCacheManager and ModelRunner.

No torch here: the scheduler side of the runtime is plain Python and testable anywhere.

Ownership:
- ``SamplingParams`` (runtime/sampling_params.py, re-exported here) and ``Request`` come
  from the user (validated at construction).
- ``Sequence`` is the scheduler's mutable per-request state (tokens, block table, status).
- ``ScheduledBatch`` is what ``Scheduler.schedule()`` hands to ``ModelRunner.step()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from llmc.base.errors import RequestError
from llmc.runtime.chat_messages import check_chat_kwargs, check_conversation, is_conversation
from llmc.runtime.fields import (  # noqa: F401 (the limits are re-exported)
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    _bad,
    _index,
    _integer,
    _real,
    _strings,
    _token_ids,
    _top_count,
)
from llmc.runtime.sampling_params import (  # noqa: F401 (re-exported)
    EARLY_STOPPING,
    FLOAT32_MAX,
    MAX_OUTPUTS,
    SamplingParams,
)

MAX_PROMPT_IDS = 1 << 24
"""More prompt ids than any engine's max_input_len: refused before they are copied."""


class RequestFault(RequestError):
    """A failure inside an engine step that one request's data caused (its step inputs,
    sampling columns, logprobs, detokenization, stop strings). Raised by the step's per-row
    work with the request's id; the Executor fails that request alone (its KV blocks freed)
    and runs the step again without it. Any other failure inside a step fails the engine."""

    def __init__(self, request_id: int, message: str) -> None:
        prefix = f"request {request_id}: "
        super().__init__(message if message.startswith(prefix) else prefix + message)
        self.request_id = request_id

    @classmethod
    def caused(cls, request_id: int, what: str, error: BaseException) -> RequestFault:
        """The fault of request ``request_id`` whose ``what`` raised ``error``."""
        return cls(request_id, f"{what} failed ({type(error).__name__}: {error})")


def row_fault(seqs: Any, work: Any, what: str) -> RequestFault | None:
    """After a batch-wide ``work`` failed: the RequestFault of the first sequence whose own
    ``work(seq)`` raises (None when none does: the failure is not one request's)."""
    for seq in seqs:
        try:
            work(seq)
        except Exception as e:  # the fault is this request's, whatever its type
            return RequestFault.caused(seq.request_id, what, e)
    return None


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

    _field_kind = "request field"  # how its errors name a field (fields._bad)

    prompt: str | list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    """Higher is served first among waiting requests; arrival order within a priority."""
    streaming: bool = False
    apply_chat_template: bool = False
    """Render ``prompt`` with the engine's chat template: a user message (a string) or a
    whole conversation (a list of ``{"role", "content"}`` dicts: system, user, assistant)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None
    """Arguments of the chat template's rendering (``add_generation_prompt``, ``tools``,
    template-specific ones such as ``enable_thinking``), with ``apply_chat_template``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """The one home of the request rules (types and ranges; the vocabulary and the
        engine's limits are the Executor's and the scheduler's to check). Run at
        construction and again by ``Executor.enqueue_request`` (a Request is mutable).
        Normalizes ``prompt_token_ids`` to a list of ints. RequestError names the field."""
        if is_conversation(self.prompt):  # a conversation: only for the chat template
            self.prompt = check_conversation(self.prompt, self.apply_chat_template is True)
        elif self.prompt is not None and not isinstance(self.prompt, str):
            raise _bad(self, "prompt", "must be a string (or give prompt_token_ids)")
        if self.prompt_token_ids is not None:
            if is_conversation(self.prompt_token_ids):
                check_conversation(self.prompt_token_ids, False, "prompt_token_ids")
            if isinstance(self.prompt_token_ids, (str, bytes)):
                raise _bad(self, "prompt_token_ids", "must be a list of token ids")
            self.prompt_token_ids = _token_ids(
                self, "prompt_token_ids", MAX_PROMPT_IDS, ranged=False
            )
        if self.prompt is not None and self.prompt_token_ids is not None:
            raise RequestError("give the prompt as text or as token ids, not both")
        if not isinstance(self.sampling, SamplingParams):
            raise _bad(self, "sampling", "must be a SamplingParams")
        self.priority = _integer(self, "priority", -INT32_MAX, INT32_MAX)
        for name in ("streaming", "apply_chat_template"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(self, name, "must be True or False")
        if not isinstance(self.metadata, dict):
            raise _bad(self, "metadata", "must be a dict")
        check_chat_kwargs(self.chat_template_kwargs, self.apply_chat_template)
        if self.streaming and self.sampling.ranks_by_logprob:
            raise RequestError(
                f"streaming with best_of={self.sampling.best_of} > n={self.sampling.n}: "
                "the n best samples are known only at the end; stream with best_of=n"
            )


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
    the table (``decode_row_cache.DecodeRowCache``) re-reads it exactly when this changed."""
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
    suppressed_ids: tuple[int, ...] = ()
    """With ``sampling.min_tokens``: the ids that would stop it (``Scheduler._stop_ids``, set
    by ``Scheduler.add``), masked before sampling while it has fewer outputs than that."""
    branch: int = 0
    """Which of its request's sequences this is (``SamplingParams.num_branches``): the
    sample's output index and seed stream, or a beam's slot. 0 for a plain request."""
    group: Any = None
    """The ``branches.SequenceGroup`` of a request with several sequences (n / best_of
    samples, beams), shared by all of them; None for a plain request."""
    shares_last_block: bool = False
    """Set by the KVCacheManager's fork: the last block may be another branch's too, so the
    next write into it copies it first (copy-on-write, ``KVCacheManager.append_slots``)."""
    slot: int = -1
    """Its row in the scheduler's ``SlotState`` arrays (``runtime/slot_state.py``) while it
    runs, else -1: assigned at admission (or a fork), freed at finish and preemption."""

    @property
    def key(self) -> tuple[int, int]:
        """(request id, branch): unique per sequence, the key of the scheduler's and the KV
        manager's per-sequence state."""
        return (self.request_id, self.branch)

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
        step in flight is sampling (``len(output_token_ids) + 1``); the slot arrays' paths
        (``scheduler_slots``) ask ``last_by_length`` of whole rows at once."""
        return last_by_length(num_output_tokens, self.max_new_tokens)


def last_by_length(num_output_tokens: Any, max_new_tokens: Any) -> Any:
    """The length rule of ``Sequence.is_last_by_length`` on ints or on numpy arrays of rows
    (``max_new_tokens`` is the whole length limit, see ``Sequence.max_new_tokens``)."""
    return num_output_tokens >= max_new_tokens


class ScheduledSequence(NamedTuple):
    """One request's share of a step: tokens [start, start + num_new_tokens) are computed.

    ``sample`` is True when the step ends at the last known token of the sequence (the last
    prefill chunk or a decode step), i.e. the step produces a new token for it.

    A named tuple (immutable, equal by its fields, ``Sequence`` by identity): the scheduler
    makes one per decode row per step, ``tuple.__new__`` over mapped fields
    (``scheduler_slots.decode_slices``), at a third of a frozen dataclass's cost.
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


MAX_WINDOW_STOP_IDS = 16
"""Most stop ids (EOS included) a row of a multi-step window may have: the device checks
them in a fixed-width table. A row with more decodes one step per host iteration."""


def stop_ids(sp: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """Every id that ends a request with params ``sp``: its ``stop_token_ids`` and, unless
    ``ignore_eos``, the model's EOS ids. The one statement of the rule (the scheduler's
    ``update`` and the device's check of a multi-step window both use it)."""
    ids = frozenset(sp.stop_token_ids)
    return ids if sp.ignore_eos else ids | eos_token_ids


@dataclass(frozen=True)
class DecodeWindow:
    """Multi-step decoding: a decode-only batch whose rows run ``num_steps`` decode steps on
    the device in one host iteration, each step's sampled token fed back on the device.
    The scheduler reserved the KV blocks of every row's next ``min(num_steps, tokens it
    may still make)`` tokens (``WindowScheduling.plan_window``); the device stops a row at
    its stop ids (``stop_ids(sampling, eos_token_ids)``) or its last token by length, and
    the host catches up once (``WindowScheduling.update_window``)."""

    num_steps: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class ScheduledBatch:
    """The output of Scheduler.schedule(): what one engine step computes."""

    step_id: int
    sequences: tuple[ScheduledSequence, ...]
    preempted_request_ids: tuple[int, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    """(source, destination) KV blocks the runner copies before the step's forward: the
    copy-on-write of a forked sequence's shared last block (``KVCacheManager``)."""
    branching: bool = False
    """Some row forks (its request's first token, with several outputs) or is a beam: the
    runner's fork and beam work applies (``llmc.runtime.beam_search``)."""
    window: DecodeWindow | None = None
    """Multi-step decoding: the decode steps this batch runs per host iteration (None: one)."""
    rows: Any = field(default=None, compare=False, repr=False)
    """``slot_state.DecodeRows`` of ``sequences`` when the scheduler made every row a decode
    row over the slot arrays (None otherwise): the vectorised update, step inputs and
    records read them while ``DecodeRows.valid``. Whoever changes ``sequences`` drops it."""
    prefix_rows: Any = field(default=None, compare=False, repr=False)
    """``slot_state.DecodeRows`` of the first ``len(prefix_rows.seqs)`` of ``sequences``
    when they are decode rows over the slot arrays and other rows follow them (a step with
    prompt chunks; None otherwise): the update and the step inputs apply those rows at
    once, the rest per row. Whoever changes ``sequences`` drops it."""

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
