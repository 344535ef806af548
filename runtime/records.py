"""Timing records the runtime writes and bench/profile read (they never re-time things).

Times are ``time.perf_counter()`` seconds. The Executor fills one ``RequestRecord`` per
request and one ``StepRecord`` per engine step; ``llmc.runtime.bench.metrics`` aggregates them.
The per-request latencies (``ttft``, ``tpot``, ``itls``, ``e2e``) are defined here once: the
outputs' ``timings`` and the wing's aggregates both read them.
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
    num_steps: int = 1
    """Decode steps the device ran in this host iteration (multi-step decoding: K; its
    ``num_tokens`` count every step's rows)."""


# ---- per-request latencies (seconds; None: no data) -----------------------------------
def ttft(r: RequestRecord) -> float | None:
    if r.first_token_time is None:
        return None
    return r.first_token_time - r.arrival_time


def last_token_time(r: RequestRecord) -> float | None:
    if r.token_times:
        return r.token_times[-1]
    return r.finish_time if r.num_output_tokens == 1 else None


def tpot(r: RequestRecord) -> float | None:
    """Mean time per output token after the first; None below two output tokens."""
    last = last_token_time(r)
    if r.first_token_time is None or last is None or r.num_output_tokens < 2:
        return None
    return (last - r.first_token_time) / (r.num_output_tokens - 1)


def itls(r: RequestRecord) -> list[float]:
    t = r.token_times
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def e2e(r: RequestRecord) -> float | None:
    if r.finish_time is None:
        return None
    return r.finish_time - r.arrival_time
