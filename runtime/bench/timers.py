"""The timers behind the one profiler (runtime/bench/profiling.py): phase, op and kernel
timing, breakdowns, peak memory, and a Chrome trace.

Sources (nothing here re-times a step; steps come from the Executor's StepRecords):
- Phases: ``StepRecord.phase_times`` (schedule, prepare, forward, sample, update), summed.
- Ops on CPU: ``OpTimer`` wraps the backend's op methods with wall-clock hooks and records
  each call (name, start, end, FLOPs and bytes where the shapes give them).
- Kernels on CUDA: ``KernelProfiler`` runs the workload under ``torch.profiler`` and reads
  the CUDA kernel events (CUDA-graph replays included), grouped into families by name.
- Trace: ``write_chrome_trace`` writes Chrome/Perfetto JSON: on the engine thread each step
  is an "X" event with its ops nested inside (clipped to the step); phases on their own
  track, laid end to end in schedule → update order; KV utilization and running batch as
  counters; GPU kernels on a GPU process track.

Invariants: op and kernel times are perf_counter seconds aligned with the step records;
a breakdown over no data is empty, never zeros.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.cuda.backend import BACKEND_OPS
from llmc.runtime.records import StepRecord

PHASES = ("schedule", "prepare", "forward", "sample", "update")


@dataclass(frozen=True)
class OpEvent:
    """One backend op call (CPU) or CUDA kernel, on the step records' clock."""

    name: str
    start: float
    """perf_counter seconds, like StepRecord.start_time (kernels are shifted onto it)."""
    end: float
    flops: float | None = None
    """FLOPs of the call from its tensor shapes (None: unknown, e.g. a kernel)."""
    bytes: float | None = None
    """Bytes it read and wrote (None: unknown)."""
    family: str | None = None
    """``kernel_family`` of the name (matmul, attention, ...)."""
    stream: int = 0
    """A kernel's GPU track (torch.profiler's device_index): its thread id in the trace."""


@dataclass(frozen=True)
class BreakdownRow:
    name: str
    count: int
    total_s: float
    share: float
    """Fraction of the breakdown's total time."""
    mean_s: float
    tflops: float | None = None
    gb_s: float | None = None


# ---- phases -------------------------------------------------------------------------------


def phase_breakdown(steps: Sequence[StepRecord]) -> list[BreakdownRow]:
    """Time per phase summed over steps; 'other' is step time the phases do not cover."""
    if not steps:
        return []
    total = sum(s.end_time - s.start_time for s in steps)
    sums = {p: 0.0 for p in PHASES}
    extra: dict[str, float] = {}
    for s in steps:
        for k, v in s.phase_times.items():
            (sums if k in sums else extra)[k] = (sums if k in sums else extra).get(k, 0.0) + v
    rows = []
    for name, t in [*sums.items(), *sorted(extra.items())]:
        if t > 0:
            rows.append(
                BreakdownRow(name, len(steps), t, t / total if total else 0.0, t / len(steps))
            )
    other = total - sum(sums.values()) - sum(extra.values())
    if other > 1e-9:
        rows.append(BreakdownRow("other", len(steps), other, other / total, other / len(steps)))
    return rows


# ---- ops and kernels ------------------------------------------------------------------------

_FAMILIES: tuple[tuple[str, str], ...] = (
    ("attention", r"attn|attention|flash|fmha|paged|sdpa|softmax_kv|decode_kernel"),
    (
        "matmul",
        r"gemm|gemv|gate_up_silu|cutlass|cublas|nvjet|xmma|matmul|linear|\bmm\b|addmm"
        r"|sm\d+_.*tn|s\d+gemm",
    ),
    ("norm", r"rms|norm"),
    ("rope / kv write", r"rope|rotary|cache_write|reshape_and_cache|slot"),
    ("activation", r"silu|gelu|act_and_mul|swiglu|and_mul"),
    ("sampling", r"sample|argmax|topk|top_k|sort|philox|gumbel|multinomial|softmax|cumsum"),
    ("embedding", r"embed|index_select|gather"),
    ("copy / fill", r"copy|memcpy|memset|fill|cat|elementwise"),
)


def kernel_family(name: str) -> str:
    """Family of a kernel or op name ('matmul', 'attention', ...; 'other' if unknown)."""
    low = name.lower()
    for family, pattern in _FAMILIES:
        if re.search(pattern, low):
            return family
    return "other"


def op_breakdown(events: Sequence[OpEvent], by: str = "name") -> list[BreakdownRow]:
    """Per op name (or per ``family``): count, time, share, achieved TFLOP/s and GB/s."""
    groups: dict[str, list[OpEvent]] = {}
    for e in events:
        key = e.name if by == "name" else (e.family or kernel_family(e.name))
        groups.setdefault(key, []).append(e)
    total = sum(e.end - e.start for e in events)
    rows = []
    for key, evs in groups.items():
        t = sum(e.end - e.start for e in evs)
        flops = [e.flops for e in evs if e.flops is not None]
        nbytes = [e.bytes for e in evs if e.bytes is not None]
        rows.append(
            BreakdownRow(
                name=key,
                count=len(evs),
                total_s=t,
                share=t / total if total > 0 else 0.0,
                mean_s=t / len(evs),
                tflops=sum(flops) / t / 1e12
                if flops and len(flops) == len(evs) and t > 0
                else None,
                gb_s=sum(nbytes) / t / 1e9
                if nbytes and len(nbytes) == len(evs) and t > 0
                else None,
            )
        )
    return sorted(rows, key=lambda r: -r.total_s)


def with_model_rates(
    rows: Sequence[BreakdownRow],
    *,
    matmul_flops: float | None,
    weight_bytes_read: float | None,
    attention_flops: float | None,
) -> list[BreakdownRow]:
    """Fill the matmul and attention families' rates from the model's FLOPs and weight
    bytes where the events carry none (GPU kernels): what the kernels achieved for the
    work the model needed."""
    from dataclasses import replace

    out = []
    for r in rows:
        t = r.total_s
        if r.name == "matmul" and t > 0:
            r = replace(
                r,
                tflops=r.tflops if r.tflops is not None else (
                    matmul_flops / t / 1e12 if matmul_flops else None
                ),
                gb_s=r.gb_s if r.gb_s is not None else (
                    weight_bytes_read / t / 1e9 if weight_bytes_read else None
                ),
            )  # fmt: skip
        elif r.name == "attention" and t > 0 and r.tflops is None and attention_flops:
            r = replace(r, tflops=attention_flops / t / 1e12)
        out.append(r)
    return out


def _op_cost(
    name: str, args: tuple, kwargs: dict, result: Any
) -> tuple[float | None, float | None]:
    """FLOPs and bytes moved of one backend op call, from its tensor shapes."""

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size() if hasattr(t, "numel") else 0

    if name == "linear" and len(args) >= 2:
        x, w = args[0], args[1]
        flops = 2.0 * x.shape[0] * w.shape[0] * w.shape[1]
        return flops, float(nbytes(x) + nbytes(w) + nbytes(result))
    if name in ("norm_linear", "norm_gate_up_silu", "linear_residual_add") and len(args) >= 2:
        # fused small-batch GEMVs: (residual, norm_w, eps, weight, ...) or (x, weight, residual)
        x, w = (args[0], args[1]) if name == "linear_residual_add" else (args[0], args[3])
        flops = 2.0 * x.shape[0] * w.shape[0] * w.shape[1]
        out = args[2] if name == "linear_residual_add" else result
        return flops, float(nbytes(x) + nbytes(w) + nbytes(out))
    if name in ("rms_norm", "silu_and_mul", "embedding") and args:
        out = result[0] if isinstance(result, tuple) else result
        return None, float(nbytes(args[0]) + nbytes(out))
    if name == "add_rms_norm" and len(args) >= 2:
        return None, float(3 * nbytes(args[0]) + nbytes(result[0]))
    return None, None


class OpTimer:
    """Wall-clock hooks on a backend's op methods (CPU: ops run synchronously).

    ``attach(backend)`` shadows each op method on the instance with a timed wrapper;
    ``detach()`` restores them. Calls are recorded into ``events``.
    """

    def __init__(self, ops: Sequence[str] = BACKEND_OPS) -> None:
        self.ops = tuple(ops)
        self.events: list[OpEvent] = []
        self._attached: list[tuple[Any, str, bool, Any]] = []

    def attach(self, backend: Any) -> OpTimer:
        for name in self.ops:
            fn = getattr(backend, name, None)
            if fn is None:
                continue
            had_own = name in getattr(backend, "__dict__", {})
            self._attached.append((backend, name, had_own, fn))
            setattr(backend, name, self._wrap(name, fn))
        return self

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
            try:
                flops, nbytes = _op_cost(name, args, kwargs, out)
            except (AttributeError, IndexError, TypeError):  # not tensors: no cost known
                flops, nbytes = None, None
            self.events.append(OpEvent(name, t0, t1, flops, nbytes, kernel_family(name)))
            return out

        return timed

    def detach(self) -> None:
        for backend, name, had_own, fn in reversed(self._attached):
            if had_own:
                setattr(backend, name, fn)
            else:
                delattr(backend, name)
        self._attached.clear()


class KernelProfiler:
    """CUDA kernel events of a region, via ``torch.profiler`` (CUPTI sees graph replays).

    Use as a context manager around the workload; ``events`` then holds one OpEvent per
    kernel, its times converted to perf_counter seconds through a marker whose
    perf_counter time is known.
    """

    MARKER = "llmc::clock_sync"

    def __init__(self) -> None:
        self.events: list[OpEvent] = []
        self.error: str | None = None
        self._prof: Any = None
        self._marker_t: float = 0.0

    def __enter__(self) -> KernelProfiler:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._prof.__enter__()
        with record_function(self.MARKER):
            self._marker_t = time.perf_counter()
        torch.cuda.synchronize()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        torch.cuda.synchronize()
        self._prof.__exit__(*exc)
        try:
            self.events = self._collect()
        except Exception as e:  # the profiler's event API differs between torch versions
            self.error = f"could not read kernel events from torch.profiler: {e!r}"

    def _collect(self) -> list[OpEvent]:
        evs = self._prof.events()
        marker = next((e for e in evs if e.name == self.MARKER), None)
        if marker is None:
            raise RuntimeError("clock marker not found in the profile")
        offset = self._marker_t - marker.time_range.start / 1e6
        out = []
        for e in evs:
            if getattr(e.device_type, "name", str(e.device_type)) != "CUDA":
                continue
            start = e.time_range.start / 1e6 + offset
            end = e.time_range.end / 1e6 + offset
            stream = int(getattr(e, "device_index", 0) or 0)
            out.append(OpEvent(e.name, start, end, family=kernel_family(e.name), stream=stream))
        return out


# ---- memory ------------------------------------------------------------------------------


def peak_memory(device: Any) -> dict[str, Any]:
    """Measured peak allocation: CUDA allocator peak, or the process's max RSS on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return {"kind": "cuda max_memory_allocated", "bytes": torch.cuda.max_memory_allocated()}
    try:
        import resource

        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"kind": "process max RSS (includes Python and torch)", "bytes": rss_kib * 1024}
    except (ImportError, OSError):
        return {"kind": "unavailable", "bytes": None}


# ---- Chrome / Perfetto trace ---------------------------------------------------------------


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def chrome_trace(
    steps: Sequence[StepRecord],
    ops: Sequence[OpEvent] = (),
    kernels: Sequence[OpEvent] = (),
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trace dict: steps with nested ops (pid 1 tid 1), phases (tid 2), counters, kernels."""
    starts = [s.start_time for s in steps] + [e.start for e in ops] + [k.start for k in kernels]
    t0 = min(starts) if starts else 0.0
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "llmc engine (host)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "steps + ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "phases"}},
    ]
    ordered = sorted(steps, key=lambda s: s.start_time)
    for s in ordered:
        ev.append(
            {
                "ph": "X",
                "cat": "step",
                "name": f"step {s.step_id}",
                "pid": 1,
                "tid": 1,
                "ts": _us(s.start_time, t0),
                "dur": _us(s.end_time, s.start_time),
                "args": {
                    "num_tokens": s.num_tokens,
                    "prefill_tokens": s.num_prefill_tokens,
                    "decode_tokens": s.num_decode_tokens,
                    "batch_size": s.batch_size,
                    "kv_blocks_used": s.kv_blocks_used,
                    "kv_blocks_total": s.kv_blocks_total,
                    "preempted": s.num_preempted,
                },
            }
        )
        t = s.start_time
        for name in [*PHASES, *sorted(set(s.phase_times) - set(PHASES))]:
            d = min(s.phase_times.get(name, 0.0), max(s.end_time - t, 0.0))
            if d > 0:
                ev.append(
                    {
                        "ph": "X",
                        "cat": "phase",
                        "name": name,
                        "pid": 1,
                        "tid": 2,
                        "ts": _us(t, t0),
                        "dur": round(d * 1e6, 3),
                        "args": {"step": s.step_id},
                    }
                )
                t += d
        util = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        ev.append(
            {
                "ph": "C",
                "name": "kv_utilization",
                "pid": 1,
                "ts": _us(s.start_time, t0),
                "args": {"used": round(util, 4)},
            }
        )
        ev.append(
            {
                "ph": "C",
                "name": "running_batch",
                "pid": 1,
                "ts": _us(s.start_time, t0),
                "args": {"requests": s.batch_size, "tokens": s.num_tokens},
            }
        )
    # ops nest inside their step on tid 1: clip each op to the step containing its start
    si = 0
    for e in sorted(ops, key=lambda e: e.start):
        while si < len(ordered) and ordered[si].end_time < e.start:
            si += 1
        if si >= len(ordered) or e.start < ordered[si].start_time:
            continue  # outside every step (e.g. warm-up); it would break the nesting
        end = min(e.end, ordered[si].end_time)
        args = {k: v for k, v in (("flops", e.flops), ("bytes", e.bytes)) if v is not None}
        ev.append(
            {
                "ph": "X",
                "cat": "op",
                "name": e.name,
                "pid": 1,
                "tid": 1,
                "ts": _us(e.start, t0),
                "dur": _us(end, e.start),
                "args": {"step": ordered[si].step_id, "family": e.family, **args},
            }
        )
    if kernels:
        ev.append({"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "GPU"}})
    for k in kernels:
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": k.name,
                "pid": 2,
                "tid": k.stream,
                "ts": _us(k.start, t0),
                "dur": _us(k.end, k.start),
                "args": {"family": k.family},
            }
        )
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": metadata or {}}


def write_chrome_trace(path: str | Path, trace: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(trace))
    return p
