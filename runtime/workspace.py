"""The static memory of one step: the workspace arena and the host→device staging buffer.

``Workspace`` allocates ONE uint8 arena and takes a typed view per buffer at its offset in a
memory plan (``PlannedBuffer``s of ``llmc.compiler.memory_plan``, the one table of the
buffers' names, shapes and live ranges: plan.json's, or the planner's for a run's lowered
limits, see ``run_workspace``). The packer guarantees that buffers live at the same time
never share bytes, and ``load_engine`` refuses a plan.json that is not the planner's.

``Staging`` packs a step's host-side inputs into one (pinned, on CUDA) byte buffer so that
they reach the device in ONE host→device copy; typed device views are returned per section.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from llmc.base.errors import EngineError
from llmc.compiler.memory_plan import PlannedBuffer, arena_bytes

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int64": torch.int64,
    "int32": torch.int32,
}


class Workspace:
    """One uint8 arena on ``device`` and a typed view per planned buffer, at its offset."""

    def __init__(self, buffers: Sequence[PlannedBuffer], device: torch.device) -> None:
        self.nbytes = arena_bytes(list(buffers))
        self.arena = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.buffers: dict[str, torch.Tensor] = {
            b.name: self.arena[b.offset : b.offset + b.nbytes]
            .view(TORCH_DTYPES[b.dtype])
            .view(b.shape)
            for b in buffers
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]


class Staging:
    """Host byte buffers (pinned on CUDA) + one device mirror: a step's inputs in one copy.

    Usage per step: ``begin()``, ``add(name, values, dtype)`` per section, then
    ``upload()`` → {name: device tensor}. Sections are 8-byte aligned and packed in the
    order added; only the used prefix is copied. On CUDA there are two host buffers used in
    turn, so a step can be staged while the previous step's copy may still be in flight;
    ``begin()`` waits for the copy that last read the buffer it reuses (a CUDA event). The
    device mirror is the same for every step (CUDA graphs read fixed addresses); a later
    step's copy into it is ordered after the earlier step's kernels by the stream. On CPU
    the host buffer is the "device" buffer and everything is synchronous.
    """

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.device = device
        self.capacity = capacity_bytes
        cuda = device.type == "cuda"
        self._hosts = [
            torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=cuda)
            for _ in range(2 if cuda else 1)
        ]
        self._nps = [h.numpy() for h in self._hosts]
        self._events: list[Any] = [None] * len(self._hosts)
        self._turn = 0
        self.host = self._hosts[0]
        self._np = self._nps[0]
        self.dev = self.host if not cuda else torch.empty_like(self.host, device=device)
        self._sections: list[tuple[str, int, int, torch.dtype]] = []
        self._used = 0
        self._viewed: list[tuple[str, int, int, torch.dtype]] | None = None
        self._views: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        if len(self._hosts) > 1:
            self._turn ^= 1
            event = self._events[self._turn]
            if event is not None:
                event.synchronize()  # the copy that last read this host buffer is done
            self.host, self._np = self._hosts[self._turn], self._nps[self._turn]
        self._sections = []
        self._used = 0

    def add(self, name: str, values: Sequence | np.ndarray, dtype: str) -> None:
        self.reserve(name, len(values), dtype)[:] = values

    def reserve(self, name: str, n: int, dtype: str) -> np.ndarray:
        """Add a section of ``n`` values and return its host view, to be filled in place
        before ``upload()`` (``add`` is ``reserve`` + assignment)."""
        np_dtype = np.dtype(dtype)
        nbytes = n * np_dtype.itemsize
        off = -(-self._used // 8) * 8
        if off + nbytes > self.capacity:
            raise EngineError(f"step staging overflow at {name!r} ({off + nbytes} bytes)")
        self._sections.append((name, off, n, TORCH_DTYPES[dtype]))
        self._used = off + nbytes
        return self._np[off : off + nbytes].view(np_dtype)

    @property
    def used(self) -> int:
        """Bytes of the sections added since ``begin()``."""
        return self._used

    def offsets(self) -> dict[str, int]:
        """Each section's byte offset (a tensor-parallel follower rebuilds the views)."""
        return {name: off for name, off, _, _ in self._sections}

    def views(self, layout: dict[str, tuple[int, int, str]]) -> dict[str, torch.Tensor]:
        """Typed views of the device mirror: name → (byte offset, values, dtype)."""
        return {
            name: self.dev[off : off + n * TORCH_DTYPES[dt].itemsize].view(TORCH_DTYPES[dt])
            for name, (off, n, dt) in layout.items()
        }

    def upload(self) -> dict[str, torch.Tensor]:
        if self.dev is not self.host and self._used:
            self.dev[: self._used].copy_(self.host[: self._used], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        if self._sections != self._viewed:  # the same layout as last step: the same views
            self._viewed = list(self._sections)
            self._views = {
                name: self.dev[off : off + n * dt.itemsize].view(dt)
                for name, off, n, dt in self._sections
            }
        return dict(self._views)
