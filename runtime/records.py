"""Timing records the runtime writes and bench/profile read (they never re-time things).

Times are ``time.perf_counter()`` seconds. The Executor fills one ``RequestRecord`` per
request and one ``StepRecord`` per engine step; ``llmc.runtime.bench.metrics`` aggregates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    scheduled_time: float | None = None
    """First step that computed any of its tokens."""
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    """Time each output token became available (first entry == first_token_time)."""
    finish_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class StepRecord:
    step_id: int
    start_time: float
    end_time: float
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preempted: int = 0
    phase_times: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: schedule, prepare, forward, sample, update."""
