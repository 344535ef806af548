"""Scheduler configuration, statistics and request admission checks (no torch).

Owns what the ``Scheduler`` is configured with and what it refuses at the door:
- the capacity policy names (``GUARANTEED_NO_EVICT``, ``MAX_UTILIZATION``, ``POLICIES``);
- ``SchedulerConfig`` (frozen; validated on construction, ConfigError naming the field);
- ``SchedulerStats`` (a frozen snapshot of the scheduler's counters);
- ``kv_tokens_needed`` (cached tokens at the end of a sequence's life) and
  ``check_new_sequence``, the per-request checks that ``Scheduler.add`` runs.

Invariants: a sequence that passes ``check_new_sequence`` has a non-empty prompt of at most
``max_input_len`` tokens, ``max_new_tokens >= 1``, prompt + ``max_new_tokens`` at most
``max_seq_len`` (``max_new_tokens`` is lowered to the room left only when the request asked
for ``clamp_max_new_tokens``), and its whole life fits in the KV pool, so neither capacity
policy can livelock on it. Every refusal is a RequestError naming the request id. The checks
touch nothing but the sequence's ``max_new_tokens`` (when clamped); the scheduler's queues are
the scheduler's. This module imports neither torch nor the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.base.errors import ConfigError, RequestError
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.types import Sequence, SequenceStatus

GUARANTEED_NO_EVICT = "guaranteed_no_evict"
MAX_UTILIZATION = "max_utilization"
POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine (from its build config) and the capacity policy."""

    max_num_tokens: int
    """Per-step token budget (decode tokens + prefill chunks)."""
    max_batch_size: int
    """Most running sequences."""
    max_seq_len: int
    """Longest prompt + generated tokens."""
    max_input_len: int
    """Longest prompt."""
    tokens_per_block: int
    enable_chunked_prefill: bool = True
    policy: str = GUARANTEED_NO_EVICT
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of the model (ignored by requests with ignore_eos)."""

    def __post_init__(self) -> None:
        names = ("max_num_tokens", "max_batch_size", "max_seq_len", "max_input_len")
        for name in (*names, "tokens_per_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"scheduler {name} must be a positive integer, got {v!r}")
        if self.policy not in POLICIES:
            raise ConfigError(
                f"scheduler policy {self.policy!r} is not one of {', '.join(POLICIES)}"
            )
        if self.max_input_len > self.max_seq_len:
            raise ConfigError(
                f"max_input_len ({self.max_input_len}) must not exceed "
                f"max_seq_len ({self.max_seq_len})"
            )
        if not self.enable_chunked_prefill and self.max_num_tokens < self.max_input_len:
            raise ConfigError(
                f"max_num_tokens ({self.max_num_tokens}) is smaller than max_input_len "
                f"({self.max_input_len}) with chunked prefill off: a prompt could never be "
                "scheduled; raise max_num_tokens or enable chunked prefill"
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


def check_new_sequence(cfg: SchedulerConfig, kv: KVCacheManager, seq: Sequence) -> None:
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
    if n_prompt > cfg.max_input_len:
        raise RequestError(
            f"request {rid}: prompt has {n_prompt} tokens, more than the engine's "
            f"max_input_len={cfg.max_input_len}"
        )
    if not isinstance(seq.max_new_tokens, int) or seq.max_new_tokens < 1:
        raise RequestError(f"request {rid}: max_new_tokens={seq.max_new_tokens!r} is not >= 1")
    if n_prompt + seq.max_new_tokens > cfg.max_seq_len:
        room = cfg.max_seq_len - n_prompt
        if not seq.sampling.clamp_max_new_tokens or room < 1:
            raise RequestError(
                f"request {rid}: prompt ({n_prompt} tokens) + max_new_tokens "
                f"({seq.max_new_tokens}) = {n_prompt + seq.max_new_tokens} exceeds the "
                f"engine's max_seq_len={cfg.max_seq_len}; shorten the prompt, lower "
                "max_new_tokens"
                + (" or set clamp_max_new_tokens" if room >= 1 else " (no room is left)")
            )
        seq.max_new_tokens = room
    need_blocks = kv.blocks_for_tokens(kv_tokens_needed(seq))
    if need_blocks > kv.total_blocks:
        raise RequestError(
            f"request {rid}: needs {need_blocks} KV-cache blocks ({n_prompt} prompt + "
            f"{seq.max_new_tokens} new tokens, {kv.tokens_per_block} tokens per block) "
            f"but the whole pool has {kv.total_blocks}; it could never run"
        )
