"""Fixtures of the server tests: the tiny engine served, and real server processes.

``serve_engine`` is the small tiny-llama engine the other test folders share
(``SMALL_LIMITS``: max_batch_size 8, max_seq_len 128, max_input_len 64). ``start_server``
is a factory: ``start_server(*args)`` starts ``llmc serve ARGS`` on a free 127.0.0.1 port
(``helpers.server.ServerProcess``) and stops it in the test's finaliser; ``shared_server``
is one default server for a whole module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.engines import SMALL_LIMITS
from helpers.server import ServerProcess


@pytest.fixture(scope="session")
def serve_engine(tiny_engine, tiny_llama_dir) -> Path:
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess.start(list(args), env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def shared_server(serve_engine) -> Iterator[ServerProcess]:
    server = ServerProcess.start(["--engine", f"tiny={serve_engine}"])
    yield server
    server.stop()
