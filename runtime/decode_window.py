"""Multi-step decoding on the device: the state of a window of K decode steps and the op
that feeds each step's sampled tokens to the next (``ScheduledBatch.window``).

The runner stages a window's step inputs once (``StepInputBuilder``, its block tables wide
enough for every row's reserved tokens), then runs K times: forward + sample (eagerly, or
the decode CUDA graph of the batch's bucket) and ``WindowState.advance``, which on the
device, with no host synchronisation:

- writes the step's sampled ids into row ``j`` of the window's output (``-1`` for a row
  already stopped: its later tokens are discarded);
- stops a row whose id is one of its stop ids (``types.stop_ids``: a fixed-width table of
  ``MAX_WINDOW_STOP_IDS``, -1 padded) or that made its last token by length (``remaining``:
  the tokens it makes at most in the window, ``window_span``);
- advances the next step's inputs in place: input id = the sampled id, position and
  seq_len + 1, cache slot from the block table, RNG offset + 1 (a row's seed stream is
  indexed by its output token number, so the tokens equal those of single steps); a
  stopped row keeps its position and gets slot -1, so it writes no KV any more.

The step counter is a device tensor, so ``advance`` has fixed addresses and shapes per row
count and is captured as a CUDA graph per decode-graph bucket (``DecodeGraphs``). The ids
come back with ONE device→host copy of the ``[K, rows]`` output after the last step.

Invariants: rows ``>= b`` (graph padding) start stopped (``remaining = 0``); only rows of a
plain, decode-only batch are staged (``Scheduler.plan_window`` guarantees it); the buffers
are allocated once for ``max_batch_size`` rows and ``max_steps`` steps.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np
import torch

from llmc.base.errors import EngineError
from llmc.compiler.limits import EngineLimits
from llmc.runtime.scheduler_window import tokens_left
from llmc.runtime.types import MAX_WINDOW_STOP_IDS, ScheduledSequence, stop_ids
from llmc.runtime.workspace import Staging

_SEQ = operator.attrgetter("seq")
_PARAMS = operator.attrgetter("sampling")

STOP_WIDTH = MAX_WINDOW_STOP_IDS


def window_span(rows: tuple[ScheduledSequence, ...], num_steps: int) -> np.ndarray:
    """[b] int64: the tokens each row of a ``num_steps`` window makes at most (its steps, or
    fewer when its max_tokens comes first): the positions it computes."""
    return np.minimum(num_steps, tokens_left(list(map(_SEQ, rows))))


class WindowState:
    """The device buffers of multi-step windows (one window at a time) and ``advance``."""

    def __init__(self, limits: EngineLimits, device: torch.device, max_steps: int) -> None:
        if max_steps < 2:
            raise EngineError(f"a multi-step window has at least 2 steps, got {max_steps}")
        rows = limits.max_batch_size
        self.rows, self.max_steps, self.device = rows, max_steps, device
        self.tokens_per_block = limits.tokens_per_block
        i64 = dict(dtype=torch.int64, device=device)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.remaining = torch.zeros(rows, **i64)
        self.stop = torch.full((rows, STOP_WIDTH), -1, **i64)
        self.out = torch.full((max_steps * rows,), -1, **i64)  # [K, rows] row-major
        self.step = torch.zeros(1, **i64)
        self._rows = torch.arange(rows, **i64)
        self.staging = Staging(8 * rows * (1 + STOP_WIDTH) + 64, device)
        pin = device.type == "cuda"
        self.host = torch.empty(max_steps, rows, dtype=torch.int64, pin_memory=pin)
        self._stop_rows: dict[int, tuple[Any, np.ndarray]] = {}
        self.unread = False

    def _stop_row(self, params: Any, eos: frozenset[int]) -> np.ndarray:
        """The stop-table row of ``params`` (cached by identity; the entry keeps it alive)."""
        hit = self._stop_rows.get(id(params))
        if hit is not None and hit[0] is params:
            return hit[1]
        ids = sorted(stop_ids(params, eos))
        if len(ids) > STOP_WIDTH:
            raise EngineError(f"{len(ids)} stop ids exceed a window's {STOP_WIDTH} (bug)")
        row = np.full(STOP_WIDTH, -1, dtype=np.int64)
        row[: len(ids)] = ids
        if len(self._stop_rows) >= 4096:
            self._stop_rows.clear()
        self._stop_rows[id(params)] = (params, row)
        return row

    def stage(
        self,
        rows: tuple[ScheduledSequence, ...],
        n: int,
        eos: frozenset[int],
        span: np.ndarray,
    ) -> None:
        """Start a window over ``rows`` (``n >= len(rows)`` rows computed; the rest are
        padding, stopped from the start) of which row ``i`` makes at most ``span[i]`` tokens
        (``window_span``): those counts and the stop tables uploaded, rows not stopped,
        step counter 0."""
        if self.unread:
            raise EngineError("a multi-step window is launched while the last is unread")
        seqs = list(map(_SEQ, rows))
        b = len(seqs)
        st = self.staging
        st.begin()
        left = st.reserve("remaining", n, "int64")
        left[:b] = span
        left[b:] = 0
        table = st.reserve("stop", n * STOP_WIDTH, "int64").reshape(n, STOP_WIDTH)
        params = list(map(_PARAMS, seqs))
        if b and all(map(operator.is_, params, itertools.repeat(params[0]))):
            table[:b] = self._stop_row(params[0], eos)
        elif b:
            table[:b] = np.stack([self._stop_row(p, eos) for p in params])
        table[b:] = -1
        dev = st.upload()
        self.remaining[:n].copy_(dev["remaining"])
        self.stop[:n].copy_(dev["stop"].view(n, STOP_WIDTH))
        torch.le(self.remaining[:n], 0, out=self.done[:n])
        self.step.zero_()

    def advance(
        self,
        n: int,
        sampled: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        block_tables: torch.Tensor,
    ) -> None:
        """After a step of the window's first ``n`` rows sampled ``sampled`` [n] int64: record
        the ids, stop rows, and advance ``inputs`` (input_ids, positions, slot_mapping
        [n] int64; seq_lens [n] int32; offsets [n] int64) in place; ``block_tables`` [n, w]
        int32 holds every live row's blocks for its next position. Capturable."""
        done, tpb = self.done[:n], self.tokens_per_block
        kept = torch.where(done, torch.full_like(sampled, -1), sampled)
        self.out.index_copy_(0, self.step * self.rows + self._rows[:n], kept)
        hit = (sampled[:, None] == self.stop[:n]).any(dim=1)
        hit |= self.remaining[:n] <= self.step + 1
        done |= hit
        live = ~done
        inputs["input_ids"].copy_(torch.where(done, torch.zeros_like(sampled), sampled))
        positions = inputs["positions"]
        positions += live.to(positions.dtype)
        inputs["seq_lens"] += live.to(inputs["seq_lens"].dtype)
        inputs["offsets"] += 1
        col = (positions // tpb).clamp(max=block_tables.shape[1] - 1)
        block = block_tables.gather(1, col[:, None]).squeeze(1).to(torch.int64)
        slots = block * tpb + positions % tpb
        inputs["slot_mapping"].copy_(torch.where(done, torch.full_like(slots, -1), slots))
        self.step += 1

    def read_back(self, k: int) -> tuple[torch.Tensor, Any]:
        """Start the device→host copy of the first ``k`` steps' ids: (host [k, rows], event)."""
        src = self.out.view(self.max_steps, self.rows)[:k]
        host = self.host[:k]
        self.unread = True
        if self.device.type == "cuda":
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return host, event
        host.copy_(src)
        return host, None

    def row_tokens(self, host: torch.Tensor, b: int) -> list[list[int]]:
        """Each of the first ``b`` rows' tokens from a read-back ``host`` [k, rows] (a
        stopped row's later -1 entries dropped)."""
        self.unread = False
        rows = host[:, :b].t().tolist()
        return [r[: r.index(-1)] if -1 in r else r for r in rows]
