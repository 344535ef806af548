"""Benchmark aggregates computed from the runtime's own records (never re-timed here).

Inputs are the Executor's ``RequestRecord`` list (one per request) and ``StepRecord`` list
(one per engine step) of the measured window; definitions are written out in docs/BENCH.md:

- TTFT = first_token_time - arrival_time (queueing + prefill included).
- TPOT = (last_token_time - first_token_time) / (num_output_tokens - 1): the mean gap between
  output tokens *after* the first; requests with a single output token have no TPOT.
- ITL = every gap between consecutive output tokens of a request, pooled over requests.
- E2E latency = finish_time - arrival_time.
- Per-user tokens/s = 1 / TPOT of each request (the decode speed one user sees).
- Throughputs divide by the measured window (first arrival to last finish) in seconds.

Invariant: missing data is ``None`` (rendered "n/a"), never a zero. A statistic over an
empty set is None; a rate over a zero-length window is None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from llmc.runtime.records import RequestRecord, StepRecord, e2e, itls, tpot, ttft

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an ascending, non-empty sequence."""
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    rank = p / 100.0 * (len(sorted_values) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def percentile_key(p: float) -> str:
    """'p50', 'p99.9': the JSON key of a percentile."""
    return f"p{p:g}"


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency-like quantity (seconds, or tokens/s for per-user speed)."""

    count: int
    mean: float
    median: float
    stdev: float
    min: float
    max: float
    percentiles: dict[str, float] = field(default_factory=dict)

    def get(self, p: float) -> float | None:
        return self.percentiles.get(percentile_key(p))


def summarize(values: Iterable[float], percentiles: Sequence[float]) -> Distribution | None:
    """Distribution of ``values``; None when there are none."""
    xs = sorted(values)
    if not xs:
        return None
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / n
    return Distribution(
        count=n,
        mean=mean,
        median=percentile(xs, 50.0),
        stdev=math.sqrt(var),
        min=xs[0],
        max=xs[-1],
        percentiles={percentile_key(p): percentile(xs, p) for p in percentiles},
    )


# ---- per-request quantities -----------------------------------------------------------


def is_failed(r: RequestRecord) -> bool:
    return r.error is not None or r.finish_reason == "error"


# ---- aggregates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    request_id: int
    reason: str


@dataclass(frozen=True)
class Aggregates:
    """Every headline number of one benchmark run. Rates are per second of ``duration_s``."""

    num_requests: int
    num_completed: int
    num_failed: int
    failures: list[Failure]
    duration_s: float | None
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float | None
    output_tokens_per_s: float | None
    total_tokens_per_s: float | None
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None
    per_user_tokens_per_s: Distribution | None
    num_steps: int
    busy_time_s: float | None
    """Sum of step durations: the time the engine was computing."""
    kv_blocks_total: int | None
    kv_capacity_tokens: int | None
    kv_peak_blocks_used: int | None
    kv_peak_utilization: float | None
    kv_mean_utilization: float | None
    """Step-duration-weighted mean of blocks used / blocks total."""
    num_preemptions: int
    prefix_hit_rate: float | None
    """Prompt tokens served from reused KV blocks / prompt tokens of completed requests."""
    mean_batch_size: float | None
    peak_batch_size: int | None
    mean_tokens_per_step: float | None
    peak_tokens_per_step: int | None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["percentiles"] = list(self.percentiles)
        return d


def _rate(count: float, seconds: float | None) -> float | None:
    if seconds is None or seconds <= 0:
        return None
    return count / seconds


def _weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float | None:
    if not values:
        return None
    total = sum(weights)
    if total <= 0:
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total


def aggregate(
    requests: Sequence[RequestRecord],
    steps: Sequence[StepRecord],
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    tokens_per_block: int | None = None,
    window: tuple[float, float] | None = None,
) -> Aggregates:
    """Aggregate the measured requests and steps.

    ``window`` (start, end) in perf_counter seconds overrides the default measured window
    (first arrival to last finish among ``requests``).
    """
    for p in percentiles:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile {p} is outside [0, 100]")
    pcts = tuple(float(p) for p in percentiles)
    done = [r for r in requests if not is_failed(r) and r.finish_time is not None]
    failures = [
        Failure(r.request_id, r.error or r.finish_reason or "unfinished")
        for r in requests
        if is_failed(r) or r.finish_time is None
    ]

    if window is not None:
        duration: float | None = window[1] - window[0]
    else:
        finishes = [r.finish_time for r in requests if r.finish_time is not None]
        duration = max(finishes) - min(r.arrival_time for r in requests) if finishes else None

    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    tpots = [t for t in map(tpot, done) if t is not None]

    step_durs = [s.end_time - s.start_time for s in steps]
    kv_total = max((s.kv_blocks_total for s in steps), default=None) or None
    kv_utils = [s.kv_blocks_used / s.kv_blocks_total for s in steps if s.kv_blocks_total > 0]
    kv_weights = [d for s, d in zip(steps, step_durs, strict=True) if s.kv_blocks_total > 0]
    step_preempt = sum(s.num_preempted for s in steps)
    req_preempt = sum(r.num_preemptions for r in requests)

    return Aggregates(
        num_requests=len(requests),
        num_completed=len(done),
        num_failed=len(failures),
        failures=failures,
        duration_s=duration,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        request_throughput=_rate(len(done), duration) if done else None,
        output_tokens_per_s=_rate(output_tokens, duration) if done else None,
        total_tokens_per_s=_rate(prompt_tokens + output_tokens, duration) if done else None,
        ttft=summarize((t for t in map(ttft, done) if t is not None), pcts),
        tpot=summarize(tpots, pcts),
        itl=summarize((g for r in done for g in itls(r)), pcts),
        e2e=summarize((t for t in map(e2e, done) if t is not None), pcts),
        per_user_tokens_per_s=summarize((1.0 / t for t in tpots if t > 0), pcts),
        num_steps=len(steps),
        busy_time_s=sum(step_durs) if steps else None,
        kv_blocks_total=kv_total,
        kv_capacity_tokens=kv_total * tokens_per_block if kv_total and tokens_per_block else None,
        kv_peak_blocks_used=max((s.kv_blocks_used for s in steps), default=None),
        kv_peak_utilization=max(kv_utils) if kv_utils else None,
        kv_mean_utilization=_weighted_mean(kv_utils, kv_weights),
        num_preemptions=max(step_preempt, req_preempt),
        prefix_hit_rate=(
            sum(r.num_cached_tokens for r in done) / prompt_tokens if prompt_tokens else None
        ),
        mean_batch_size=(sum(s.batch_size for s in steps) / len(steps)) if steps else None,
        peak_batch_size=max((s.batch_size for s in steps), default=None),
        mean_tokens_per_step=(sum(s.num_tokens for s in steps) / len(steps)) if steps else None,
        peak_tokens_per_step=max((s.num_tokens for s in steps), default=None),
        percentiles=pcts,
    )


# ---- achieved rates against the hardware ceilings -------------------------------------------


@dataclass(frozen=True)
class Achieved:
    """What the engine achieved against measured ceilings; None where an input is missing."""

    weight_bytes: int | None
    total_flops: float | None
    weight_read_gb_s: float | None
    """weight_bytes × steps / busy time: each step reads every weight once."""
    tflops: float | None
    """Model FLOPs of the computed tokens / busy time."""
    copy_bandwidth_gb_s: float | None
    matmul_tflops: float | None
    bandwidth_utilization: float | None
    mfu: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_flops(r: RequestRecord, flops_at_zero: float, flops_per_context: float) -> float:
    """Model FLOPs to serve one request: its uncached prompt positions and fed-back outputs.

    A token at position p costs ``flops_at_zero + flops_per_context * p`` (matmuls plus
    attention over p earlier tokens); the last output token is never fed back.
    """
    positions = list(range(r.num_cached_tokens, r.num_prompt_tokens))
    start = r.num_prompt_tokens
    positions_count = len(positions) + max(r.num_output_tokens - 1, 0)
    pos_sum = sum(positions) + sum(range(start, start + max(r.num_output_tokens - 1, 0)))
    return positions_count * flops_at_zero + flops_per_context * pos_sum


def achieved(
    agg: Aggregates,
    requests: Sequence[RequestRecord],
    *,
    weight_bytes: int | None,
    flops_at_zero: float | None,
    flops_per_context: float | None,
    copy_bandwidth_gb_s: float | None,
    matmul_tflops: float | None,
) -> Achieved:
    busy = agg.busy_time_s if agg.busy_time_s and agg.busy_time_s > 0 else None
    done = [r for r in requests if not is_failed(r) and r.finish_time is not None]
    flops = None
    if flops_at_zero is not None and flops_per_context is not None and done:
        flops = sum(request_flops(r, flops_at_zero, flops_per_context) for r in done)
    bw = weight_bytes * agg.num_steps / busy / 1e9 if weight_bytes and busy else None
    tf = flops / busy / 1e12 if flops is not None and busy else None
    return Achieved(
        weight_bytes=weight_bytes,
        total_flops=flops,
        weight_read_gb_s=bw,
        tflops=tf,
        copy_bandwidth_gb_s=copy_bandwidth_gb_s,
        matmul_tflops=matmul_tflops,
        bandwidth_utilization=bw / copy_bandwidth_gb_s if bw and copy_bandwidth_gb_s else None,
        mfu=tf / matmul_tflops if tf and matmul_tflops else None,
    )
