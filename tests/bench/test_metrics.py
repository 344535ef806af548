"""Metric math against a hand-computed synthetic timeline (numbers worked out by hand)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmc.runtime.bench.metrics import achieved, aggregate, percentile, request_flops, summarize
from llmc.runtime.records import RequestRecord, StepRecord


def _timeline() -> tuple[list[RequestRecord], list[StepRecord]]:
    reqs = [
        RequestRecord(0, 0.0, 10, 0.0, 0.5, [0.5, 0.7, 1.0, 1.1], 1.1, 4, finish_reason="length"),
        RequestRecord(
            1, 0.2, 20, 0.5, 1.0, [1.0, 1.5], 1.5, 2, num_cached_tokens=8, finish_reason="length"
        ),
        RequestRecord(2, 0.4, 6, 0.5, 0.6, [0.6], 0.6, 1, finish_reason="length"),
        RequestRecord(3, 0.1, 9000, finish_time=0.1, finish_reason="error", error="too long"),
    ]
    steps = [
        StepRecord(0, 0.0, 0.5, 10, 10, 0, 1, 1, 10),
        StepRecord(1, 0.5, 0.6, 7, 6, 1, 2, 3, 10),
        StepRecord(2, 0.6, 1.0, 21, 20, 1, 2, 4, 10, num_preempted=1),
        StepRecord(3, 1.0, 1.1, 2, 0, 2, 2, 4, 10),
        StepRecord(4, 1.1, 1.5, 1, 0, 1, 1, 2, 10),
    ]
    return reqs, steps


def test_hand_computed_timeline() -> None:
    reqs, steps = _timeline()
    a = aggregate(reqs, steps, percentiles=(50, 90, 99), tokens_per_block=16)
    approx = pytest.approx
    assert (a.num_requests, a.num_completed, a.num_failed) == (4, 3, 1)
    assert a.failures[0].request_id == 3 and a.failures[0].reason == "too long"
    assert a.duration_s == approx(1.5)
    assert a.request_throughput == approx(2.0)
    assert a.total_output_tokens == 7 and a.total_prompt_tokens == 36
    assert a.output_tokens_per_s == approx(7 / 1.5)
    assert a.total_tokens_per_s == approx(43 / 1.5)
    # TTFT: 0.5, 0.8, 0.2
    assert a.ttft.mean == approx(0.5) and a.ttft.median == approx(0.5)
    assert a.ttft.get(90) == approx(0.74) and a.ttft.get(99) == approx(0.794)
    assert (a.ttft.min, a.ttft.max) == (approx(0.2), approx(0.8))
    # TPOT excludes the first token: (1.1-0.5)/3 = 0.2 and (1.5-1.0)/1 = 0.5; none for req 2
    assert a.tpot.count == 2 and a.tpot.mean == approx(0.35) and a.tpot.get(90) == approx(0.47)
    # ITL pooled: 0.2, 0.3, 0.1, 0.5
    assert a.itl.count == 4 and a.itl.mean == approx(0.275) and a.itl.median == approx(0.25)
    assert a.itl.get(90) == approx(0.44)
    # E2E: 1.1, 1.3, 0.2
    assert a.e2e.median == approx(1.1) and a.e2e.mean == approx(2.6 / 3)
    assert a.per_user_tokens_per_s.mean == approx(3.5)  # 1/0.2 and 1/0.5
    # steps
    assert a.num_steps == 5 and a.busy_time_s == approx(1.5)
    assert a.kv_blocks_total == 10 and a.kv_capacity_tokens == 160
    assert a.kv_peak_blocks_used == 4 and a.kv_peak_utilization == approx(0.4)
    assert a.kv_mean_utilization == approx(0.36 / 1.5)
    assert a.num_preemptions == 1
    assert a.prefix_hit_rate == approx(8 / 36)
    assert a.mean_batch_size == approx(1.6) and a.peak_batch_size == 2
    assert a.mean_tokens_per_step == approx(8.2) and a.peak_tokens_per_step == 21


def test_missing_data_is_none_not_zero() -> None:
    a = aggregate([RequestRecord(0, 0.0, 5, error="bad", finish_reason="error")], [])
    assert a.num_failed == 1 and a.num_completed == 0
    for name in (
        "duration_s",
        "request_throughput",
        "output_tokens_per_s",
        "ttft",
        "tpot",
        "itl",
        "e2e",
        "kv_peak_utilization",
        "kv_mean_utilization",
        "prefix_hit_rate",
        "mean_batch_size",
        "busy_time_s",
        "kv_capacity_tokens",
    ):
        assert getattr(a, name) is None, name


def test_window_overrides_duration() -> None:
    reqs, steps = _timeline()
    a = aggregate(reqs, steps, window=(0.0, 3.0))
    assert a.duration_s == 3.0 and a.request_throughput == pytest.approx(1.0)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = sorted(rng.random() for _ in range(n))
        for p in (0, 12.5, 50, 90, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    d = summarize([3.0, 1.0, 2.0], (50, 99.9))
    assert d.percentiles == {"p50": 2.0, "p99.9": pytest.approx(2.998)}
    assert summarize([], (50,)) is None
    with pytest.raises(ValueError):
        aggregate([], [], percentiles=(101,))


def test_achieved_rates() -> None:
    reqs, steps = _timeline()
    a = aggregate(reqs, steps)
    # request 0: positions 0..9 (prefill) and 10..12 (fed-back outputs) -> 13 tokens, sum 78
    assert request_flops(reqs[0], 100.0, 2.0) == pytest.approx(13 * 100 + 2 * 78)
    # request 1: 8 cached -> positions 8..19 and 20 -> 13 tokens, sum 182
    assert request_flops(reqs[1], 100.0, 2.0) == pytest.approx(13 * 100 + 2 * 182)
    x = achieved(
        a,
        reqs,
        weight_bytes=10**9,
        flops_at_zero=100.0,
        flops_per_context=2.0,
        copy_bandwidth_gb_s=10.0,
        matmul_tflops=None,
    )
    assert x.weight_read_gb_s == pytest.approx(5 / 1.5)  # 5 steps x 1 GB / 1.5 s
    assert x.bandwidth_utilization == pytest.approx(5 / 1.5 / 10)
    flops = 1456 + 1664 + 6 * 100 + 2 * 15  # req 2: positions 0..5
    assert x.total_flops == pytest.approx(flops)
    assert x.tflops == pytest.approx(flops / 1.5 / 1e12)
    assert x.mfu is None  # no matmul ceiling: missing, not zero
