"""Routing policies: which replica of a model serves the next request.

``round_robin`` (the seed's ``set_routing_policy("round_robin")``) takes the replicas in
turn; ``least_loaded`` takes the one with the fewest unfinished requests (``Replica.load``),
the first in order on a tie. A policy sees only replicas that are ready; both are O(replicas)
and hold no lock (they run on the event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Loaded(Protocol):
    @property
    def load(self) -> int: ...


class RoundRobin:
    """Replicas in turn, whatever their load."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, replicas: Sequence[Loaded]) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i


class LeastLoaded:
    """The replica with the fewest unfinished requests (the first on a tie)."""

    def pick(self, replicas: Sequence[Loaded]) -> int:
        loads = [r.load for r in replicas]
        return loads.index(min(loads))


def make_policy(name: str) -> RoundRobin | LeastLoaded:
    """The policy called ``name`` (ServeConfig has checked it is one of ROUTING_POLICIES)."""
    return RoundRobin() if name == "round_robin" else LeastLoaded()
