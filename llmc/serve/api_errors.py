"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Every failure the server answers goes through ``APIError``: a bad field (400, ``param``
naming it), a missing or wrong key (401), an unknown model or route (404), a body over the
limit (413), a full queue, loading or draining (503 with ``Retry-After``), and a failure of
one request's processing (500). Messages are the llmc errors' own (``printable``, cut to
a bounded length); no traceback ever reaches a client.
"""

from __future__ import annotations

import json
from typing import Any

from llmc.base.text import printable

MAX_MESSAGE_CHARS = 2000

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An answer other than success, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        text = printable(str(message))
        if len(text) > MAX_MESSAGE_CHARS:
            text = text[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(text)
        self.status, self.message, self.param, self.code = status, text, param, code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        fallback = "server_error" if self.status >= 500 else "invalid_request_error"
        return TYPES.get(self.status, fallback)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def sse_event(self) -> bytes:
        """The error as one server-sent event (a stream that already started cannot change
        its status: OpenAI's servers send the error object as a ``data:`` event)."""
        return b"data: " + self.body_bytes() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int, code: str = "server_unavailable") -> APIError:
    return APIError(503, message, code=code, retry_after=retry_after)
