"""llmc.runtime.gc_heap: the heap frozen for a run (collected first, given back after), and
``run_workload`` freezing it around the measured requests only (not the warm-up)."""

from __future__ import annotations

import gc
import weakref

import pytest

from llmc.runtime.bench import benchmark
from llmc.runtime.bench.workload import ArrivalSpec
from llmc.runtime.gc_heap import freeze_heap, frozen_heap, unfreeze_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen():
    unfreeze_heap()  # whatever ran before
    yield
    unfreeze_heap()


def test_frozen_heap_collects_first_freezes_then_gives_back():
    garbage = _Cycle()
    dead = weakref.ref(garbage)
    del garbage  # a reference cycle: only the cyclic collector frees it
    kept = [object() for _ in range(3)]
    with frozen_heap():
        assert dead() is None  # collected before the freeze, not frozen alive
        assert gc.get_freeze_count() > 0
        assert kept  # live objects stay usable while frozen
    assert gc.get_freeze_count() == 0


def test_frozen_heap_gives_back_on_error():
    with pytest.raises(RuntimeError, match="boom"), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_freeze_and_unfreeze_pair():
    freeze_heap()
    assert gc.get_freeze_count() > 0
    unfreeze_heap()
    assert gc.get_freeze_count() == 0


class _Engine:
    """What run_workload reads of a Served engine outside _run_closed."""

    step_records: list = []
    request_records: list = []


def test_run_workload_freezes_the_measured_requests_only(monkeypatch):
    seen: list[tuple[int, int]] = []

    def fake_run_closed(engine, reqs, limit, progress, how):
        seen.append((len(reqs), gc.get_freeze_count()))
        return {}

    monkeypatch.setattr(benchmark, "_run_closed", fake_run_closed)
    run = benchmark.run_workload(_Engine(), ["a", "b", "c"], ArrivalSpec(), warmup=["w"])
    assert seen[0] == (1, 0)  # the warm-up: not frozen
    assert seen[1][0] == 3 and seen[1][1] > 0  # the measured requests: frozen
    assert gc.get_freeze_count() == 0  # given back after
    assert run.requests == [] and run.steps == []
