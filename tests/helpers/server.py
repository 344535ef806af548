"""A real ``llmc serve`` process for the tests, and plain HTTP helpers to talk to it.

``ServerProcess.start(args)`` runs ``python -m llmc.cli.main serve ARGS --port 0`` on
127.0.0.1 (never another address), reads the port it prints, and waits for ``/health`` to
say 200; ``stop()`` sends SIGTERM and kills the process if it has not exited in time (the
fixtures call it from a finaliser, so no test leaves a server behind). Every wait is
bounded. ``request`` / ``post_json`` use the standard library's ``http.client``;
``metrics`` parses ``/metrics`` with prometheus-client's own text parser.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int = 0
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        cmd = [sys.executable, "-m", "llmc.cli.main", "serve", "--host", HOST, "--port", "0"]
        full_env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen(
            cmd + ["--device", "cpu", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=full_env,
            text=True,
        )
        server = cls(proc)
        threading.Thread(target=server._read, daemon=True).start()
        try:
            server._wait_ready()
        except BaseException:
            server.stop()
            raise
        return server

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmc serve exited with {self.proc.returncode}:\n{self.log}")
            if not self.port:
                for line in list(self.lines):
                    if "listening on http://" in line:
                        self.port = int(line.rsplit(":", 1)[1])
            elif request(self.port, "GET", "/health")[0] == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"llmc serve did not get ready in {START_TIMEOUT_S:g} s:\n{self.log}")

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request; status 0 when the connection failed."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except (ConnectionError, OSError):
        return 0, {}, b""
    finally:
        conn.close()


def post_json(
    port: int, path: str, obj: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """POST a JSON body; (status, headers, parsed JSON body or the raw text)."""
    h = {"Content-Type": "application/json", **(headers or {})}
    status, hdrs, raw = request(port, "POST", path, json.dumps(obj).encode(), h)
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an event stream (parsed JSON, or the text ``[DONE]``)."""
    out: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, raw = request(port, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lv), v in samples.items() if n == name and want <= set(lv))
