"""The engine process's garbage collector: paused for a CUDA-graph capture, the heap frozen
while a run is served (no torch).

``gc_paused``: collect now and not again until the block ends (a graph capture, in
llmc.runtime.cuda_graphs / prefill_graphs / piecewise_graphs).

Python's cyclic garbage collector walks every tracked object of the generations it collects,
and a full (generation 2) collection in the middle of a run walks the whole heap of an
engine process (torch's modules, the engine's own objects) while the step loop waits: on
this 2-core CPU, scripts/host_overhead.py's host-bound 135M-shape run (4,096 requests
128/128, batch 1,024) paid two of them a run, 135-272 ms together. ``freeze_heap`` collects
once and moves every object alive then into the permanent generation (``gc.freeze``), so
later collections walk only what the run itself allocates (18-27 ms in the same run), and
``unfreeze_heap`` gives them back to the collector. vLLM and SGLang freeze the heap after
start-up the same way. Objects frozen are never freed by the cyclic collector while frozen
(reference counting still frees them), so the freeze spans a run, not a process's life:
``llmc bench`` / ``llmc profile`` freeze around their measured requests
(``llmc.runtime.bench.benchmark.run_workload``), ``llmc serve`` from "ready" to its exit.
Not re-entrant: the process's one freeze, taken and given back by its top-level run.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_heap() -> None:
    """Collect, then freeze every object alive now (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector (``gc.unfreeze``)."""
    gc.unfreeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """``freeze_heap()`` for the ``with`` block, ``unfreeze_heap()`` after it."""
    freeze_heap()
    try:
        yield
    finally:
        unfreeze_heap()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage now, and not again until the block ends (a graph capture): a
    collection during capture can free an earlier runtime's pinned buffers or events
    (cudaFreeHost / event calls are illegal while capturing and invalidate the capture)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
