"""Scheduler configuration, statistics and request admission checks (no torch).

Owns what the ``Scheduler`` is configured with and what it refuses at the door:
- the capacity policy names (``GUARANTEED_NO_EVICT``, ``MAX_UTILIZATION``, ``POLICIES``);
- ``SchedulerConfig`` (frozen): the engine's ``EngineLimits`` (validated where they are
  built, ``llmc.compiler.limits``), the capacity policy and the model's end-of-sequence ids;
- ``SchedulerStats`` (a frozen snapshot of the scheduler's counters);
- ``kv_tokens_needed`` (cached tokens at the end of a sequence's life) and
  ``check_new_sequence``, the per-request checks that ``Scheduler.add`` runs.

Invariants: a sequence that passes ``check_new_sequence`` has a non-empty prompt of at most
``max_input_len`` tokens, ``max_new_tokens >= 1``, prompt + ``max_new_tokens`` at most
``max_seq_len`` (``max_new_tokens`` is lowered to the room left only when the request asked
for ``clamp_max_new_tokens``), and its whole life fits in the KV pool, so neither capacity
policy can livelock on it (all of its ``num_branches`` sequences' lives, for a request
with several; ``check_width`` bounds their number). Every refusal is a RequestError naming
the request id. The checks touch nothing but the sequence's ``max_new_tokens`` (when
clamped); the scheduler's queues are the scheduler's. This module imports neither torch
nor the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.base.errors import ConfigError, RequestError
from llmc.compiler.limits import EngineLimits
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.types import Sequence, SequenceStatus

GUARANTEED_NO_EVICT = "guaranteed_no_evict"
MAX_UTILIZATION = "max_utilization"
POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION)


@dataclass(frozen=True)
class SchedulerConfig:
    """The limits the scheduler serves under and its capacity policy."""

    limits: EngineLimits
    """The run's limits: the per-step token budget (max_num_tokens), the running batch
    (max_batch_size), max_seq_len, max_input_len, tokens_per_block, chunked prefill."""
    policy: str = GUARANTEED_NO_EVICT
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of the model (ignored by requests with ignore_eos)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f"scheduler policy {self.policy!r} is not one of {', '.join(POLICIES)}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ConfigError(f"eos_token_ids must be non-negative integers: {self.eos_token_ids}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


@dataclass(frozen=True)
class SchedulerStats:
    num_steps: int
    num_scheduled_tokens: int
    num_preemptions: int
    num_finished: int
    num_running: int
    num_waiting: int
    peak_running: int


def kv_tokens_needed(seq: Sequence) -> int:
    """Cached tokens at the end of the sequence's life (the last sampled one is not)."""
    return seq.num_prompt_tokens + seq.max_new_tokens - 1


def check_new_sequence(limits: EngineLimits, kv: KVCacheManager, seq: Sequence) -> None:
    """Refuse (RequestError) a sequence that is not fresh or could never be served.

    Clamps ``seq.max_new_tokens`` to the room left under ``max_seq_len`` when the request
    set ``clamp_max_new_tokens``. Does not check for a duplicate id (the scheduler does).
    """
    rid = seq.request_id
    n_prompt = seq.num_prompt_tokens
    if seq.status is not SequenceStatus.WAITING or seq.output_token_ids or seq.block_table:
        raise RequestError(f"request {rid}: only a fresh sequence can be added")
    if n_prompt == 0:
        raise RequestError(f"request {rid}: the prompt is empty")
    if n_prompt > limits.max_input_len:
        raise RequestError(
            f"request {rid}: prompt has {n_prompt} tokens, more than the engine's "
            f"max_input_len={limits.max_input_len}"
        )
    if not isinstance(seq.max_new_tokens, int) or seq.max_new_tokens < 1:
        raise RequestError(f"request {rid}: max_new_tokens={seq.max_new_tokens!r} is not >= 1")
    if n_prompt + seq.max_new_tokens > limits.max_seq_len:
        room = limits.max_seq_len - n_prompt
        if not seq.sampling.clamp_max_new_tokens or room < 1:
            raise RequestError(
                f"request {rid}: prompt ({n_prompt} tokens) + max_new_tokens "
                f"({seq.max_new_tokens}) = {n_prompt + seq.max_new_tokens} exceeds the "
                f"engine's max_seq_len={limits.max_seq_len}; shorten the prompt, lower "
                "max_new_tokens"
                + (" or set clamp_max_new_tokens" if room >= 1 else " (no room is left)")
            )
        seq.max_new_tokens = room
    width = check_width(limits, seq)
    need_blocks = width * kv.blocks_for_tokens(kv_tokens_needed(seq))
    if need_blocks > kv.total_blocks:
        each = f" for each of {width} sequences" if width > 1 else ""
        raise RequestError(
            f"request {rid}: needs {need_blocks} KV-cache blocks ({n_prompt} prompt + "
            f"{seq.max_new_tokens} new tokens{each}, {kv.tokens_per_block} tokens per block) "
            f"but the whole pool has {kv.total_blocks}; it could never run"
        )


def check_width(limits: EngineLimits, seq: Sequence) -> int:
    """The sequences the request decodes at once (``SamplingParams.num_branches``), refused
    (RequestError naming both numbers) beyond the engine's ``max_beam_width`` (beams) or
    ``max_batch_size`` (every sequence is a row of a step; a beam group's rows run in one
    step, so its width must also fit ``max_num_tokens``)."""
    sp, rid = seq.sampling, seq.request_id
    width = sp.num_branches
    if sp.use_beam_search and width > limits.max_beam_width:
        raise RequestError(
            f"request {rid}: beam_width={width} is more beams than the engine's "
            f"max_beam_width={limits.max_beam_width}; rebuild with --max_beam_width {width}"
        )
    what = "beam_width" if sp.use_beam_search else ("best_of" if sp.best_of else "n")
    for name in ("max_batch_size", "max_num_tokens") if sp.use_beam_search else ("max_batch_size",):
        if width > getattr(limits, name):
            raise RequestError(
                f"request {rid}: {what}={width} sequences are more than the run's "
                f"{name}={getattr(limits, name)} (each is a row of a step)"
            )
    return width
