"""Kernel-argument helpers shared by the CudaBackend's op modules.

CuPy RawKernels take device pointers as ``np.uint64`` and ints as ``np.int32``; the vector
paths need 16-byte-aligned bases; every operand must be a contiguous CUDA tensor. Also the
block size of the one-CTA-per-row kernels (``row_block``).
"""

from __future__ import annotations

import numpy as np
import torch

from llmc.base.errors import UnsupportedError


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def aligned(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def need(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    if not t.is_cuda or not t.is_contiguous():
        raise UnsupportedError(f"CudaBackend: {name} must be a contiguous CUDA tensor")
    if dtype is not None and t.dtype != dtype:
        raise UnsupportedError(f"CudaBackend: {name} must be {dtype}, got {t.dtype}")


def row_block(items: int, per_thread: int, most: int = 1024) -> int:
    """Threads of a one-CTA-per-row launch whose threads keep ``per_thread`` of the row's
    ``items`` in registers: enough for the row, a warp multiple, between 32 and ``most``
    (longer rows loop over a tail)."""
    per = -(-items // per_thread)
    return min(most, max(32, (per + 31) // 32 * 32))


def rms_block(h: int, vec: int, vec_ok: bool) -> int:
    """Threads of rmsnorm.cu's kernels for rows of ``h`` elements (``vec`` per 16-byte
    vector): RMS_VPT = 4 vectors per thread on the vector path, one element per thread on
    the scalar path, at most 512 (longer rows loop over a tail)."""
    return row_block(h // vec if vec_ok else h, 4 if vec_ok else 1, most=512)
