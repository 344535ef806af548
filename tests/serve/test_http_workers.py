"""How ``llmc bench --url`` spreads its streams over client processes (runtime/bench/
http_workers.py): the split, the automatic count, a worker that dies."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

from llmc.base.errors import ConfigError
from llmc.runtime.bench import http_workers
from llmc.runtime.bench.http_driver import Endpoint
from llmc.runtime.bench.workload import ArrivalSpec, WorkloadRequest


def test_shares_and_limits() -> None:
    assert http_workers.shares(256, 4) == [64, 64, 64, 64]
    assert http_workers.shares(10, 3) == [4, 3, 3]
    assert sum(http_workers.shares(7, 7)) == 7
    assert http_workers.stream_limit(ArrivalSpec("concurrency", concurrency=5), 100) == 5
    assert http_workers.stream_limit(ArrivalSpec(), 100) == 100  # offline: every request
    assert http_workers.auto_workers(256, cpu_count=16) == 4
    assert http_workers.auto_workers(256, cpu_count=2) == 1
    assert http_workers.auto_workers(64, cpu_count=64) == 1
    assert http_workers.auto_workers(1000, cpu_count=64) == 16
    assert http_workers.auto_workers(3, cpu_count=64) == 1


def test_a_worker_that_dies_ends_the_run_naming_it() -> None:
    """Against a server that never answers, one client process is killed: the run ends with
    an error naming that worker within a second or two, and no worker is left behind."""
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "m", timeout_s=60.0)
        reqs = [WorkloadRequest(f"t{i}", 4, (1, 2, 3)) for i in range(4)]
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                http_workers.run_sharded(
                    endpoint, reqs, ArrivalSpec("concurrency", concurrency=2), 2, None
                )
            except BaseException as e:
                outcome.append(e)

        before = set(mp.active_children())
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while len(set(mp.active_children()) - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # both workers past the barrier, waiting for an answer
        victim = sorted(set(mp.active_children()) - before, key=lambda p: p.name)[1]
        victim.kill()
        t.join(30)
        assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError)
    assert "bench client worker 1" in str(outcome[0]) and "died" in str(outcome[0])
    assert not (set(mp.active_children()) - before)
