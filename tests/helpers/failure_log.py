"""A pytest plugin (loaded by tests/conftest.py): with ``LLMC_FAILED_LOG=FILE`` in the
environment, every failing test's node id and phase (``setup`` / ``call`` / ``teardown``) is
appended to FILE the moment its report arrives (with xdist: on the controller), so a device
run killed by its time limit before pytest's summary still names what failed
(scripts/device_test.sh sets it to ``$OUT/failed.txt``)."""

from __future__ import annotations

import os
from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("LLMC_FAILED_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{report.nodeid} {report.when}\n")
