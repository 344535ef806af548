"""GPU idle time of a profiled run: how long the GPU ran no kernel or copy.

From the kernel events ``llmc profile`` collects (``runtime/profiler.py``: perf_counter
seconds, aligned with the StepRecords) and the run's StepRecords. Overlapping events are
merged, so concurrent kernels count once. Used by ``llmc profile`` (one line of output and
``profile.gpu_idle`` in its JSON) and ``scripts/device_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmc.runtime.records import StepRecord

if TYPE_CHECKING:
    from llmc.runtime.bench.timers import OpEvent


@dataclass(frozen=True)
class GpuIdle:
    """Share of time the GPU ran no kernel or copy (merged kernel intervals).

    ``window_s``: from the first to the last GPU event of the run; ``decode_*``: over the
    decode-only stretch, from the first to the last step that had no prefill tokens (None
    when the run has fewer than three such steps). Host work that the GPU waits for
    (scheduling, input preparation, launches) shows up here as idle time."""

    window_s: float
    idle_share: float
    decode_window_s: float | None = None
    decode_idle_share: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return dict(self.__dict__)


def gpu_idle(kernels: Sequence[OpEvent], steps: Sequence[StepRecord]) -> GpuIdle | None:
    """GPU idle shares of a run from its kernel events (None without events)."""
    spans = sorted((k.start, k.end) for k in kernels if k.end > k.start)
    if not spans:
        return None
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def busy(lo: float, hi: float) -> float:
        return sum(min(b, hi) - max(a, lo) for a, b in merged if b > lo and a < hi)

    lo, hi = merged[0][0], merged[-1][1]
    if hi <= lo:
        return None
    dec = [s for s in steps if s.num_prefill_tokens == 0 and s.num_tokens > 0]
    d_window = d_idle = None
    if len(dec) > 2:
        d_lo, d_hi = max(dec[0].start_time, lo), min(dec[-1].end_time, hi)
        if d_hi > d_lo:
            d_window, d_idle = d_hi - d_lo, 1 - busy(d_lo, d_hi) / (d_hi - d_lo)
    return GpuIdle(hi - lo, 1 - busy(lo, hi) / (hi - lo), d_window, d_idle)
