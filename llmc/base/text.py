"""Text from files, made safe to print: the one place control characters are escaped.

Values read from files a user may not have written (an engine's manifest, a saved bench
result) reach terminals through error messages and reports. ``printable`` escapes every
control character (C0 but tab, DEL, C1, and the bidirectional overrides that reorder what a
terminal shows) as ``\\xNN`` / ``\\uNNNN``, so no escape sequence from a file is ever sent to a
terminal raw; ordinary text (newlines included) is unchanged.
"""

from __future__ import annotations

import re
from typing import Any

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any) -> str:
    """``str(value)`` with every control character escaped (see the module docstring)."""
    return _UNSAFE.sub(_escape, str(value))
