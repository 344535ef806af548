"""Type and range checks of user-given fields (no torch): the helpers behind
``SamplingParams.__post_init__`` and ``Request.validate`` (runtime/types.py).

Each returns the value normalized (numpy ints → int, reals → float, lists → tuples where the
caller wants them) or raises a RequestError naming the owner's field and what it must be.
The owner's class attribute ``_field_kind`` names the kind of field in the message.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

from llmc.base.errors import RequestError

INT32_MAX = 2**31 - 1
"""The largest count or id a step column holds (top_k is an int32 column of the kernels)."""
MAX_LOGPROBS = 20
"""The engine's logprobs limit: top alternatives a request may ask for (``logprobs``,
``prompt_logprobs``), as vLLM's ``max_logprobs``."""
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
"""Most token ids one request's ``logit_bias`` may name (each is a scatter into its logits
row, every step)."""
LOGIT_BIAS_RANGE = 100.0
"""OpenAI's range of a ``logit_bias`` value: [-100, 100] (-100 bans the token, 100 all but
forces it)."""


def _bad(owner: Any, name: str, why: str) -> RequestError:
    what = getattr(owner, "_field_kind", "field")
    return RequestError(f"{what} {name}={_shown(getattr(owner, name))}: {why}")


def _shown(value: Any) -> str:
    """``repr`` of a bad value, cut short (a hostile value may be a megabyte long)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(owner: Any, name: str, lo: int | None, hi: int | None, note: str = "") -> int:
    """``owner.name`` as an int in [lo, hi]; bools, floats and strings are refused."""
    value = _index(getattr(owner, name))
    if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = "" if lo is None and hi is None else f" in [{lo}, {hi}]"
        raise _bad(owner, name, f"must be an integer{rng}" + (f" ({note})" if note else ""))
    return value


def _real(
    owner: Any,
    name: str,
    lo: float,
    hi: float,
    note: str = "",
    *,
    open_low: bool = False,
) -> float:
    """``owner.name`` as a finite float in [lo, hi] (``(lo, hi]`` with ``open_low``)."""
    value = getattr(owner, name)
    try:  # ints and numpy floats convert; bools, strings and None do not
        number = math.nan if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    ok = math.isfinite(number) and (number > lo if open_low else number >= lo) and number <= hi
    if not ok:
        low = "(" if open_low else "["
        extra = f" ({note})" if note else ""
        raise _bad(owner, name, f"must be a finite number in {low}{lo:g}, {hi:g}]{extra}")
    return number


def _top_count(owner: Any, name: str) -> int:
    """A count of top alternatives: an integer >= 0, at most the engine's MAX_LOGPROBS
    (a larger one is refused naming both numbers)."""
    value = _index(getattr(owner, name))
    if value is None or value < 0:
        raise _bad(owner, name, "must be an integer >= 0 (0: only the token's own logprob)")
    if value > MAX_LOGPROBS:
        limit = f"{value} top logprobs are more than the engine's limit of {MAX_LOGPROBS}"
        raise _bad(owner, name, limit)
    return value


def _strings(owner: Any, name: str) -> tuple[str, ...]:
    """A tuple of non-empty strings; one plain string is one element, not its letters."""
    value = getattr(owner, name)
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) > MAX_STOP_STRINGS:
        raise _bad(owner, name, f"must be a string or a list of at most {MAX_STOP_STRINGS}")
    if any(not isinstance(x, str) or not x for x in items):
        raise _bad(owner, name, "stop strings must be non-empty strings")
    return tuple(items)


def _token_ids(
    owner: Any, name: str, limit: int = MAX_STOP_TOKEN_IDS, ranged: bool = True
) -> list[int]:
    """A list of integer token ids, in [0, INT32_MAX] when ``ranged`` (the vocabulary is
    the Executor's to check)."""
    value = getattr(owner, name)
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)) or len(items) > limit:
        raise _bad(owner, name, f"must be a list of at most {limit} token ids")
    if set(map(type, items)) <= {int}:  # plain ints, the common case: checked at C speed
        if items and ranged and (min(items) < 0 or max(items) > INT32_MAX):
            raise _bad(owner, name, "must be non-negative integer token ids")
        return list(items)
    ids = [_index(t) for t in items]
    if None in ids or (ranged and any(not 0 <= t <= INT32_MAX for t in ids)):  # type: ignore[operator]
        raise _bad(owner, name, "must be non-negative integer token ids")
    return ids  # type: ignore[return-value]


def _logit_bias(owner: Any, name: str) -> tuple[tuple[int, float], ...]:
    """A token id → bias map (a Mapping, or (id, bias) pairs) as (id, bias) pairs sorted by
    id: ids integers (or decimal strings, JSON's keys) in [0, INT32_MAX] (the vocabulary is
    the Executor's to check), each named once, at most MAX_LOGIT_BIAS of them; biases finite
    in [-100, 100]."""
    value = getattr(owner, name)
    if isinstance(value, Mapping):
        items: Any = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
        isinstance(x, (list, tuple)) and len(x) == 2 for x in value
    ):
        items = list(value)
    else:
        raise _bad(owner, name, "must map token ids to biases ({token_id: bias})")
    if len(items) > MAX_LOGIT_BIAS:
        raise _bad(owner, name, f"names {len(items)} token ids; at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in items:
        # JSON object keys are strings: OpenAI's {"50256": -100} names token 50256
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else _index(key)
        if tid is None or not 0 <= tid <= INT32_MAX:
            raise _bad(owner, name, f"key {_shown(key)} is not a non-negative integer token id")
        try:  # ints and numpy floats convert; bools, strings and None do not
            b = math.nan if isinstance(bias, (bool, str, bytes)) else float(bias)
        except (TypeError, ValueError):
            b = math.nan
        if not (math.isfinite(b) and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE):
            limit = f"[{-LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
            raise _bad(owner, name, f"bias {_shown(bias)} of token {tid} is not in {limit}")
        if tid in out:
            raise _bad(owner, name, f"names token {tid} twice")
        out[tid] = b
    return tuple(sorted(out.items()))


def _index(value: Any) -> int | None:
    """An integral value (int, numpy int) as an int; None for bools and anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
