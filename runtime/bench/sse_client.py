"""A minimal HTTP/1.1 client for streamed (server-sent events) POSTs over plain TCP.

``llmc bench --url http://...`` times a server from the client, so the client's own cost
is inside every number it reports: aiohttp spends hundreds of µs per request and tens per
chunk in its request, header and stream machinery (``scripts/serve_client_overhead.py``
measures both against a fake server). This client is the few steps a benchmark needs:

- ``SSEConnection``: one keep-alive TCP connection (TCP_NODELAY, as asyncio sets it); a
  request is one pre-encoded write; the response head is parsed once; the body is read as
  it arrives (``Transfer-Encoding: chunked``, ``Content-Length`` or until the connection
  closes) and split into SSE ``data:`` payloads, each handed over with the time its bytes
  were read.
- ``SSEPool``: connections reused across requests (one per request in flight at most).

Invariants: a connection is reused only after its response was read to its end and the
server did not ask to close it; anything else (an error, a timeout, a cancelled read)
closes it. Errors are ``SSEError`` (bad status line, truncated body), ``OSError`` or
``asyncio.TimeoutError``; the caller records them. https is not handled here (the HTTP
driver uses aiohttp for it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
READ_BYTES = 256 * 1024


class SSEError(Exception):
    """The server's answer is not HTTP/1.1 as this client reads it."""


class SSEConnection:
    """One keep-alive connection (see the module docstring)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.reusable = False
        self._headers: dict[str, str] = {}
        self._status = 0

    def close(self) -> None:
        self.reusable = False
        self.writer.close()

    async def post(self, request: bytes) -> tuple[int, dict[str, str]]:
        """Send a whole pre-encoded request; (status, lower-cased headers) of the answer."""
        self.reusable = False
        self.writer.write(request)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise SSEError("the response head is too large") from None
        except asyncio.IncompleteReadError:
            raise SSEError("the server closed the connection before answering") from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise SSEError(f"bad status line {lines[0][:100]!r}")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self._headers, self._status = headers, int(parts[1])
        return self._status, headers

    async def body(self) -> AsyncIterator[tuple[float, bytes]]:
        """The body's bytes as they arrive: (read time, bytes). Marks the connection
        reusable once the body ended as its framing says."""
        h, reader = self._headers, self.reader
        if self._status in (204, 304) or 100 <= self._status < 200:
            pass  # no body (RFC 9112 6.3)
        elif "chunked" in h.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers are sent by SSE servers
                    break
                data = await reader.readexactly(size + 2)
                yield time.perf_counter(), data[:-2]
        elif "content-length" in h:
            left = int(h["content-length"])
            while left > 0:
                data = await reader.read(min(left, READ_BYTES))
                if not data:
                    raise SSEError("the body ended before its Content-Length")
                left -= len(data)
                yield time.perf_counter(), data
        else:  # delimited by the connection's end
            while data := await reader.read(READ_BYTES):
                yield time.perf_counter(), data
            return
        self.reusable = h.get("connection", "").lower() != "close"

    async def events(self) -> AsyncIterator[tuple[float, bytes]]:
        """The body's SSE ``data:`` payloads (stripped), each with its bytes' read time."""
        pending = b""
        async for now, data in self.body():
            pending += data
            if b"\n\n" not in pending and b"\r\n\r\n" not in pending:
                continue
            *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield now, line[5:].strip()

    async def read_all(self) -> bytes:
        return b"".join([data async for _, data in self.body()])


class SSEPool:
    """Keep-alive connections to one ``http://host:port`` (see the module docstring)."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"SSEPool takes an http:// URL, not {url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.base_path = u.path.rstrip("/")
        self._idle: list[SSEConnection] = []

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """A POST of ``body`` to ``base_path + path``, encoded once."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        lines = [
            f"POST {self.base_path}{path} HTTP/1.1",
            f"Host: {host}:{self.port}",
            "Accept: text/event-stream",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def acquire(self) -> SSEConnection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEAD_BYTES)
        return SSEConnection(reader, writer)

    def release(self, conn: SSEConnection) -> None:
        if conn.reusable:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
