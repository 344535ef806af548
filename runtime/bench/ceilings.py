"""Measured hardware ceilings: memory copy bandwidth and matmul rate of one device.

Measured once per machine (device name + torch version) and cached in
``<cache_dir>/ceilings.json`` (``~/.cache/llmc`` or ``$LLMC_CACHE``) with when and how they
were measured, so every report can say where its ceiling came from.

- CUDA: device-to-device ``copy_`` of a 1 GiB buffer, bandwidth counted as bytes read +
  bytes written (the convention of bandwidth tests and gpt-fast); bf16 ``n×n @ n×n``
  matmul (n = 8192), 2·n³ FLOP each; on sm_89+ also the FP8 (e4m3) matmul of the same
  size through ``torch._scaled_mm`` with row-wise scales (what FP8 engines run), BF16 out.
  Timed with CUDA events, best of several repeats.
- CPU: ``copy_`` of a 128 MiB buffer and an fp32 matmul (n = 1024), timed with
  ``perf_counter``, best of several repeats.

Invariant: a ceiling is a measurement on this machine, never a datasheet number.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from llmc.base.paths import cache_dir

CACHE_FILE = "ceilings.json"


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_bandwidth_gb_s: float
    """Bytes read + written per second by a device-to-device copy, in GB/s (1e9)."""
    matmul_tflops: float
    matmul_dtype: str
    matmul_n: int
    copy_bytes: int
    measured_at: str
    torch_version: str
    source: str = ""
    """Where the numbers come from: 'measured now' or the cache file they were read from."""
    fp8_matmul_tflops: float | None = None
    """e4m3 row-scaled matmul rate (sm_89+ CUDA devices; None elsewhere)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_key(device: torch.device) -> str:
    """Name that identifies the machine's device: GPU name, or CPU model and core count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    return f"cpu:{cpu}:{os.cpu_count()} cores"


def _cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _time_cuda(fn: Any, repeats: int, inner: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / inner)
    return best


def _time_cpu(fn: Any, repeats: int, inner: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _copy_seconds(device: torch.device, nbytes: int, timer: Any, inner: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src), 5, inner)


def _matmul_seconds(
    device: torch.device, n: int, dtype: torch.dtype, timer: Any, inner: int
) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    return timer(lambda: torch.mm(a, b, out=out), 5, inner)


def _fp8_matmul_seconds(device: torch.device, n: int, timer: Any, inner: int) -> float | None:
    """Seconds of one n×n e4m3 ``torch._scaled_mm`` (row-wise scales), None below sm_89."""
    if torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major operand
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)

    def mm() -> Any:
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    try:
        return timer(mm, 5, inner)
    except RuntimeError:  # a torch build without FP8 GEMMs for this device
        return None


def measure(
    device: torch.device, copy_bytes: int | None = None, matmul_n: int | None = None
) -> Ceilings:
    """Measure copy bandwidth and matmul rate on ``device`` now (no cache)."""
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (1 << 30 if cuda else 128 << 20)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = _time_cuda if cuda else _time_cpu
    copy_s = _copy_seconds(device, copy_bytes, timer, 10 if cuda else 2)
    mm_s = _matmul_seconds(device, matmul_n, dtype, timer, 10 if cuda else 2)
    fp8_s = _fp8_matmul_seconds(device, matmul_n, timer, 10) if cuda else None
    if cuda:
        torch.cuda.empty_cache()
    return Ceilings(
        device=device_key(device),
        copy_bandwidth_gb_s=2 * copy_bytes / copy_s / 1e9,
        matmul_tflops=2 * matmul_n**3 / mm_s / 1e12,
        matmul_dtype=str(dtype).removeprefix("torch."),
        matmul_n=matmul_n,
        copy_bytes=copy_bytes,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        source="measured now",
        fp8_matmul_tflops=2 * matmul_n**3 / fp8_s / 1e12 if fp8_s else None,
    )


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def get_ceilings(device: torch.device | str, refresh: bool = False) -> Ceilings:
    """Cached ceilings of ``device``; measured (and cached) on first use or with refresh."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = f"{device_key(device)}|torch {torch.__version__}"
    path = _cache_path()
    cache = _read_cache(path)
    entry = cache.get(key)
    if entry and not refresh and (device.type != "cuda" or "fp8_matmul_tflops" in entry):
        try:
            c = Ceilings(**{**entry, "source": ""})
            return Ceilings(**{**asdict(c), "source": f"cached in {path} ({c.measured_at})"})
        except TypeError:
            pass  # an entry from an older layout: measure again
    c = measure(device)
    cache[key] = {k: v for k, v in asdict(c).items() if k != "source"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
        return Ceilings(**{**asdict(c), "source": f"measured now, cached in {path}"})
    except OSError:
        return c
