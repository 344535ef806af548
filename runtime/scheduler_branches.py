"""The Scheduler's work for requests with several sequences (no torch): n / best_of samples
and beams (``llmc.runtime.branches``). A mixin of ``Scheduler`` (runtime/scheduler.py, whose
module docstring states the rules): it reads and changes the scheduler's running list, KV
manager and finish / preempt paths, and nothing else.

- ``_schedule_beams``: a beam group's rows as a unit (lockstep, held-back re-prefill);
- ``_preempt`` / ``_remove_running_group``: preemption by recompute, and the unit of a
  victim (a beam group goes whole);
- ``_reserved_blocks`` / ``_unforked_rows``: what guaranteed_no_evict and the batch slots
  promised to running requests, their other sequences included;
- ``_fork_samples`` / ``_apply_beam_step``: the ``BranchStep`` of a step applied (fork,
  reorder, the search's end); ``_token_stop``: one sampled token's stop decision.
"""

from __future__ import annotations

import bisect
import logging
import operator
from typing import Any

from llmc.runtime.admission import kv_tokens_needed
from llmc.runtime.branches import BranchStep, SequenceGroup
from llmc.runtime.types import FinishReason, ScheduledSequence, Sequence, SequenceStatus

_SLOT = operator.attrgetter("slot")

logger = logging.getLogger("llmc.scheduler")


class BranchScheduling:
    """Scheduler methods for requests with several sequences (see the module docstring)."""

    _running: list[Sequence]
    _no_evict: bool
    vector_rows: int
    _num_preemptions: int
    kv: Any
    slots: Any  # the scheduler's SlotState

    def _preempt(self, seq: Sequence) -> None:
        dropped = seq.num_computed_tokens
        self.kv.free(seq)
        self.slots.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._push_waiting(seq)
        logger.info(
            "preempted request %d by recompute (%d computed tokens dropped, %d output tokens "
            "kept; %d free KV blocks); preemption %d of this request",
            seq.request_id,
            dropped,
            len(seq.output_token_ids),
            self.kv.num_free_blocks,
            seq.num_preemptions,
        )

    def _preempt_newest(self, seq: Sequence, preempted: list[int]) -> Sequence:
        """``seq`` found no free block: preempt the newest running request (its preemption
        unit) and return the victim; under guaranteed_no_evict that is a scheduler bug."""
        if self._no_evict:
            raise RuntimeError(
                f"guaranteed_no_evict: request {seq.request_id} found no free block "
                "although its blocks were reserved at admission (scheduler bug)"
            )
        victim = self._running.pop()
        for v in self._remove_running_group(victim):
            self._preempt(v)
        preempted.append(victim.request_id)
        return victim

    def _remove_running_group(self, victim: Sequence) -> list[Sequence]:
        """``victim`` (just popped from the end of the running list) and, for a beam, the
        other running beams of its group (they sit right before it): the preemption unit."""
        g = victim.group
        unit = [victim]
        if g is not None and g.beam and g.forked:
            while self._running and self._running[-1].group is g:
                unit.append(self._running.pop())
        return unit

    def _schedule_beams(
        self, i: int, budget: int, picked: list[ScheduledSequence], preempted: list[int]
    ) -> tuple[int, int]:
        """Schedule the beam group whose running beams start at ``running[i]``, as a unit:
        every beam's last token together (once all its live beams are running and computed
        up to it), or the chunks of beams still re-prefilling after a preemption, held back
        one token short. Preempts from the end when blocks run out (the group may be the
        victim). Returns the next running index and the budget left."""
        g = self._running[i].group
        m = 1
        while i + m < len(self._running) and self._running[i + m].group is g:
            m += 1
        beams = self._running[i : i + m]
        lefts = [b.num_tokens - b.num_computed_tokens for b in beams]
        plan: list[tuple[Sequence, int]] = []
        if all(left == 1 for left in lefts):
            if m == len(g.live) and budget >= m:
                plan = [(b, 1) for b in beams]
        else:
            room = budget
            for b, left in zip(beams, lefts, strict=True):
                n = min(left - 1, room)
                if n > 0:
                    plan.append((b, n))
                    room -= n
        if not plan:
            return i + m, budget
        kv = self.kv
        while sum(kv.num_blocks_needed(b, n) for b, n in plan) > kv.num_free_blocks:
            if self._preempt_newest(beams[0], preempted).group is g:
                return i, budget  # the group itself went back to the queue
        for b, n in plan:
            if not kv.append_slots(b, n):
                raise RuntimeError(f"request {b.request_id}: beam block count was wrong (bug)")
            self.slots.write(b)
            picked.append(self._slice(b, n))
            budget -= n
        return i + m, budget

    def _reserved_blocks(self) -> int:
        """Blocks promised to running requests but not allocated yet (guaranteed_no_evict).

        A request with several sequences was promised ``width`` lives; it holds the distinct
        blocks of its sequences' tables (shared ones once), and its beams may free and take
        blocks as they reorder, never holding more than the promise."""
        total = 0
        seen: set[int] = set()
        running = self._running
        if len(running) >= self.vector_rows:  # the ungrouped rows over the slot arrays
            st = self.slots
            np = st._np
            slots = np.fromiter(map(_SLOT, running), dtype=np.int64, count=len(running))
            solo = ~st.grouped[slots]
            need = st.prompt_len[slots] + st.max_new[slots] - 1  # kv_tokens_needed
            life = -(-need // self.kv.tokens_per_block)  # blocks_for_tokens
            total = int((life - st.blocks[slots])[solo].sum())
            if bool(solo.all()):
                return total
            running = [running[i] for i in np.flatnonzero(~solo).tolist()]
        for s in running:
            g = s.group
            life = self.kv.blocks_for_tokens(kv_tokens_needed(s))
            if g is None:
                total += life - len(s.block_table)
            elif id(g) not in seen:
                seen.add(id(g))
                held = {b for x in g.live for b in x.block_table}
                total += g.width * life - len(held)
        return total

    def _unforked_rows(self) -> int:
        """Rows promised to running requests whose other sequences are not forked yet."""
        return sum(
            s.group.width - 1 for s in self._running if s.group is not None and not s.group.forked
        )

    @staticmethod
    def _token_stop(seq: Sequence, token: int, stop_ids: frozenset[int]) -> FinishReason | None:
        """The stop that ``token`` (just appended) decides for ``seq``, if any."""
        if token in stop_ids and len(seq.output_token_ids) > seq.sampling.min_tokens:
            seq.stop_token_id = token
            return FinishReason.STOP
        if seq.is_last_by_length(len(seq.output_token_ids)):
            return FinishReason.LENGTH
        return None

    def _new_branches(self, first: Sequence, count: int) -> list[Sequence]:
        """``count`` new running sequences of ``first``'s group (no blocks yet: ``share``)."""
        g = first.group
        made = []
        for _ in range(count):
            child = Sequence(
                request_id=first.request_id,
                prompt_token_ids=first.prompt_token_ids,
                sampling=first.sampling,
                max_new_tokens=first.max_new_tokens,
                arrival_time=first.arrival_time,
                priority=first.priority,
                branch=len(g.branches),
                group=g,
                status=SequenceStatus.RUNNING,
                num_cached_tokens=first.num_cached_tokens,
                suppressed_ids=first.suppressed_ids,
            )
            g.branches.append(child)
            self.slots.assign(child, self._stop_ids(child.sampling))
            bisect.insort(self._running, child, key=self._key)
            made.append(child)
        return made

    def _fork_samples(self, parent: Sequence, step: BranchStep) -> list[Sequence]:
        """The sample fork at ``parent``'s first token: the other samples, sharing its
        blocks, each with its own first token (and stop). Returns those that finished."""
        g = parent.group
        children = self._new_branches(parent, len(step.token_ids))
        self.kv.share([parent] * len(children), children)
        g.forked = True
        stop_ids = self._stop_ids(parent.sampling)
        done = []
        self.slots.write(parent)  # its last block is shared now
        for child, token in zip(children, step.token_ids, strict=True):
            child.output_token_ids = [*parent.output_token_ids, int(token)]
            self.slots.write(child)
            reason = self._token_stop(child, int(token), stop_ids)
            if reason is not None:
                self._running.remove(child)
                self._finish(child, reason)
                done.append(child)
        return done

    def _apply_beam_step(self, g: SequenceGroup, step: BranchStep) -> list[Sequence]:
        """Reorder ``g``'s beams as ``step`` says (the first step forks them from the
        prompt); the search's end finishes every beam. Returns the finished beams."""
        beams = g.live
        if any(b.status is not SequenceStatus.RUNNING for b in beams):
            return []  # cancelled or preempted between schedule() and update()
        k = len(step.parents)
        if len(beams) < k:
            beams += self._new_branches(beams[0], k - len(beams))
        parents = [g.branches[p] for p in step.parents]
        outs = [[*p.output_token_ids, int(t)] for p, t in zip(parents, step.token_ids, strict=True)]
        self.kv.share(parents, beams)
        for beam, out in zip(beams, outs, strict=True):
            beam.output_token_ids = out
        self.slots.write_all(g.branches)  # tables shared or reordered (finished: no slot)
        g.forked = True
        g.beam_scores = list(step.beam_scores)
        g.finished = list(step.finished)
        g.improvable = step.improvable
        if not step.done:
            return []
        reason = g.finished[0].finish_reason if g.finished else FinishReason.LENGTH
        for beam in beams:
            self._running.remove(beam)
            self._finish(beam, reason)
        return beams
