"""Scheduler: which tokens of which requests one engine step computes (no torch).

There is no prefill or decode phase: every sequence has ``num_computed_tokens`` and a step
gives tokens to sequences under one budget of ``max_num_tokens`` tokens, for at most
``max_batch_size`` running sequences. Running sequences are served first (a decode needs one
token, a sequence still in prefill gets its next chunk), then waiting ones in queue order
(``-priority``, then arrival). A waiting sequence that cannot be admitted stops admission for
the step (no overtaking inside the queue, so nothing starves).

Capacity policies (``SchedulerConfig.policy``):
- ``guaranteed_no_evict``: admit a sequence only if blocks for its whole life
  (prompt + max_new_tokens - 1 cached tokens) fit in the free pool minus what running
  sequences were already promised. Never preempts; block allocation can never fail.
- ``max_utilization``: admit when the current chunk fits. When a running sequence cannot get a
  block, the newest running sequence (last in queue order) is preempted by recompute: its
  blocks are freed (their registered content stays reusable), ``num_computed_tokens`` drops to
  0, its output tokens are kept and re-prefilled, and it rejoins the waiting queue at its
  original place, ahead of later arrivals of its priority. No admission in a step that
  preempted.

A request whose whole life can never fit in the pool is refused by ``add`` (RequestError), so
neither policy can livelock. Sequences in a ``ScheduledBatch`` are ordered decode-first.

Requests with several sequences (n / best_of samples, beams; ``llmc.runtime.branches``,
the mixin ``llmc.runtime.scheduler_branches``): the prompt is one sequence until its first
token, whose ``BranchStep`` forks the others in ``update``, sharing its blocks. Each is a row
(``max_batch_size`` counts rows; admission keeps room for all of a request's rows and, under
guaranteed_no_evict, blocks for all their lives). Samples run and stop independently; beams
run in lockstep (scheduled together or not at all; a preempted group goes back whole and
re-prefills up to the last token, which its beams then compute together).

Async scheduling (``schedule_ahead``, the mixin ``llmc.runtime.scheduler_ahead``): the next
decode step is scheduled while the step in flight runs, before its tokens are known.

Multi-step decoding (``plan_window`` / ``update_window``, the mixin
``llmc.runtime.scheduler_window``): a decode-only step of every running sequence may become
a window of K decode steps computed in one host iteration.

Stop decisions: ``update`` decides every stop that the tokens show (EOS, stop token ids,
length; see there) and records it on the Sequence (``finish_reason``, ``stop_token_id``);
``finish`` applies the ones decided outside (cancel, stop string). Nobody re-derives them.

Running sequences' per-step fields are mirrored in slot arrays (runtime/slot_state.py).

``SchedulerConfig``, ``SchedulerStats``, the policy names and the per-request admission checks
live in ``llmc.runtime.admission`` and are re-exported here.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from typing import Any

from llmc.base.errors import ConfigError, RequestError
from llmc.runtime.admission import (
    GUARANTEED_NO_EVICT,
    MAX_UTILIZATION,  # noqa: F401 (re-exported, like POLICIES)
    POLICIES,  # noqa: F401
    SchedulerConfig,
    SchedulerStats,
    check_new_sequence,
    kv_tokens_needed,
)
from llmc.runtime.branches import BranchStep, SequenceGroup
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.scheduler_ahead import AheadScheduling
from llmc.runtime.scheduler_branches import BranchScheduling
from llmc.runtime.scheduler_slots import DecodeSlices, SlotScheduling, decode_slice
from llmc.runtime.scheduler_window import WindowScheduling
from llmc.runtime.slot_state import SlotState
from llmc.runtime.types import (
    FinishReason,
    ScheduledBatch,
    ScheduledSequence,
    Sequence,
    SequenceStatus,
    stop_ids,
)

_SAMPLE = operator.attrgetter("sample")


class Scheduler(BranchScheduling, WindowScheduling, SlotScheduling, AheadScheduling):
    """In-flight batching over one KVCacheManager; see the module docstring for the rules."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        tpb = config.limits.tokens_per_block
        if tpb != kv.tokens_per_block:
            raise ConfigError(
                f"scheduler tokens_per_block ({tpb}) differs from the KV "
                f"cache's ({kv.tokens_per_block})"
            )
        self.config = config
        self.limits = config.limits
        self.kv = kv
        self._no_evict = config.policy == GUARANTEED_NO_EVICT
        self._eos = frozenset(config.eos_token_ids)
        self._stop_cache: dict[int, tuple[Any, frozenset[int]]] = {}
        self._seqs: dict[int, Sequence] = {}  # every unfinished request: its first sequence
        self._order: dict[int, int] = {}  # arrival number per request id
        self._arrivals = 0
        self._waiting: dict[tuple[int, int], Sequence] = {}  # by Sequence.key
        # (-priority, arrival, branch, request id); lazy deletion
        self._heap: list[tuple[int, int, int, int]] = []
        self._running: list[Sequence] = []  # sorted by queue key
        # the running sequences' per-step arrays
        self.slots = SlotState(config.limits.max_batch_size, config.limits.max_blocks_per_seq)
        self._step = 0
        self._num_tokens = 0
        self._num_preemptions = 0
        self._num_finished = 0
        self._peak_running = 0

    # ---------------------------------------------------------------- queue helpers
    def _key(self, seq: Sequence) -> tuple[int, int]:
        return (-seq.priority, self._order[seq.request_id])

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._waiting[seq.key] = seq
        heapq.heappush(self._heap, (*self._key(seq), seq.branch, seq.request_id))

    def _peek_waiting(self) -> Sequence | None:
        while self._heap:
            top = self._heap[0]
            seq = self._waiting.get((top[3], top[2]))
            if seq is not None:
                return seq
            heapq.heappop(self._heap)  # cancelled while waiting
        return None

    # ---------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raise RequestError if it can never be served."""
        rid = seq.request_id
        if rid in self._seqs:
            raise RequestError(f"request {rid}: a request with this id is already queued")
        check_new_sequence(self.limits, self.kv, seq)  # may clamp max_new_tokens
        seq.num_computed_tokens = 0
        seq.finish_reason = seq.stop_token_id = None
        if seq.sampling.min_tokens:  # masked before sampling until min_tokens (sampling.py)
            seq.suppressed_ids = tuple(sorted(self._stop_ids(seq.sampling)))
        sp = seq.sampling
        if sp.num_branches > 1:
            seq.group = SequenceGroup(
                sp.num_branches, sp.use_beam_search, self._stop_ids(sp), branches=[seq]
            )
        self._seqs[rid] = seq
        self._order[rid] = self._arrivals
        self._arrivals += 1
        self._push_waiting(seq)

    def finish(
        self, request_id: int, reason: FinishReason, branch: int | None = None
    ) -> Sequence | None:
        """End an unfinished request now, for a reason decided outside the scheduler (a
        cancel; a stop string, which only the detokenized text shows); returns its first
        sequence, or None if unknown. Frees its blocks whether it is waiting or running.
        ``branch``: end only that sample of a request with several (a beam ends its whole
        search)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        g = seq.group
        if g is None:
            targets = [seq]
        elif branch is None or g.beam:
            targets = g.live
        else:
            targets = [b for b in g.live if b.branch == branch]
        for t in targets:
            if self._waiting.pop(t.key, None) is None:
                self._running.remove(t)
            self._finish(t, reason)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End one sequence (its blocks freed); its request ends with its last sequence."""
        self.kv.free(seq)
        self.slots.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        g = seq.group
        if g is not None and any(b.status is not SequenceStatus.FINISHED for b in g.branches):
            return
        rid = seq.request_id
        del self._seqs[rid]
        del self._order[rid]
        self._num_finished += 1

    # ---------------------------------------------------------------- the step
    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens; allocates their KV blocks (and may preempt)."""
        cfg, kv = self.limits, self.kv
        budget = cfg.max_num_tokens
        picked: list[ScheduledSequence] = []
        preempted: list[int] = []
        branching = False

        tpb = kv.tokens_per_block

        # 1. Running sequences, in queue order; the newest is preempted when blocks run out.
        # ScheduledSequence.is_decode, decided here; the first ``fast`` rows over the slots
        decode, fast = self._decode_prefix(budget)
        i = len(decode)
        budget -= i
        if i < len(self._running) and budget > 0:  # the loop below may append decode rows
            decode = list(decode)
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            g = seq.group
            if g is not None and g.beam and g.forked:
                i, budget = self._schedule_beams(i, budget, picked, preempted)
                branching = True
                continue
            start = seq.num_computed_tokens
            n_prompt = len(seq.prompt_token_ids)
            left = n_prompt + len(seq.output_token_ids) - start
            if (
                left == 1 and start < len(seq.block_table) * tpb and not seq.shares_last_block
            ):  # its block is there already (and its own)
                ss = decode_slice(seq, start)
                (decode if start >= n_prompt else picked).append(ss)
                budget -= 1
                i += 1
                continue
            n = min(left, budget)
            scheduled = True
            while not kv.append_slots(seq, n):
                if self._preempt_newest(seq, preempted) is seq:
                    scheduled = False
                    break
            if scheduled:
                self.slots.write(seq)  # its blocks
                ss = self._slice(seq, n)
                branching = branching or (ss.sample and g is not None and not g.forked)
                (decode if n == 1 and start >= n_prompt else picked).append(ss)
                budget -= n
                i += 1

        # 2. Waiting sequences, in queue order, until one does not fit.
        if not preempted:
            budget, admitted_branching = self._admit(budget, len(self._running), picked)
            branching = branching or admitted_branching

        self._step += 1
        self._num_tokens += cfg.max_num_tokens - budget
        self._peak_running = max(self._peak_running, len(self._running))
        prefill: list[ScheduledSequence] = []
        rows: Any = decode  # the slot prefix's rows stay unbuilt when nothing follows them
        if picked:
            decode = list(decode)
            for s in picked:  # ScheduledSequence.is_decode, inlined
                if s.num_new_tokens == 1 and s.start_position >= len(s.seq.prompt_token_ids):
                    decode.append(s)
                else:
                    prefill.append(s)
            rows = tuple(decode + prefill)
        elif not isinstance(decode, DecodeSlices):
            rows = tuple(decode)
        whole = fast is not None and not prefill and len(decode) == len(fast.seqs)
        return ScheduledBatch(
            step_id=self._step - 1,
            sequences=rows,
            preempted_request_ids=tuple(preempted),
            block_copies=kv.take_copies(),
            branching=branching,
            rows=fast if whole else None,
            prefix_rows=fast
            if not whole and fast is not None and len(fast.seqs) >= self.vector_rows
            else None,
        )

    def _admit(
        self,
        budget: int,
        rows: int,
        picked: list[ScheduledSequence],
        *,
        ahead: bool = False,
        filling: set[Any] | None = None,
    ) -> tuple[int, bool]:
        """Admit waiting sequences in queue order until one does not fit (the budget of
        ``budget`` tokens, the batch's rows with ``rows`` taken by running sequences, the
        blocks of the policy), appending their first chunks to ``picked``; returns (the
        budget left, whether a chunk forks its request's samples). ``ahead``
        (``schedule_ahead``): admission also stops at a request with several sequences,
        and at one whose prefix runs into a block the step in flight fills (``filling``:
        ``KVCacheManager.filling_hashes``; the next step shares it instead)."""
        cfg, kv = self.limits, self.kv
        branching = False
        reserved: int | None = None  # computed once, when a waiting sequence is looked at
        while budget > 0 and rows < cfg.max_batch_size:
            seq = self._peek_waiting()
            if seq is None:
                break
            if reserved is None:
                reserved = self._reserved_blocks() if self._no_evict else 0
                rows += self._unforked_rows()
            g = seq.group
            if ahead and g is not None:
                break
            width = g.width if g is not None and not g.forked else 1
            if rows + width > cfg.max_batch_size:
                break
            hits = kv.prefix_hits(seq)  # (looked up once: nothing changes the cache below)
            if filling and kv.hits_after(seq, hits, filling):
                break
            cached = len(hits) * kv.tokens_per_block
            remaining = seq.num_tokens - cached
            # a re-admitted beam computes its last token with its group (lockstep)
            target = remaining - 1 if g is not None and g.beam and g.forked else remaining
            n = min(target, budget)
            # Without chunked prefill a prompt waits for a step with room for all of it; only
            # a preempted sequence longer than a whole step (prompt + outputs) is chunked.
            if n < target and not cfg.enable_chunked_prefill and target <= cfg.max_num_tokens:
                break
            if self._no_evict:
                life = width * kv.num_blocks_needed(seq, kv_tokens_needed(seq) - cached, hits)
                if life > kv.num_free_blocks - reserved:
                    break
            elif not kv.can_allocate(seq, n, hits):
                break
            del self._waiting[seq.key]
            heapq.heappop(self._heap)
            kv.allocate_prefix(seq, hits)
            if not kv.append_slots(seq, n):
                raise RuntimeError(f"request {seq.request_id}: admission check was wrong")
            if self._no_evict:
                total = width * kv.blocks_for_tokens(kv_tokens_needed(seq))
                reserved += total - len(seq.block_table)
            seq.status = SequenceStatus.RUNNING
            self.slots.assign(seq, self._stop_ids(seq.sampling))
            running = self._running
            if not running or self._key(running[-1]) < self._key(seq):
                running.append(seq)  # (the usual case: it arrived after every running one)
            else:
                bisect.insort(running, seq, key=self._key)
            rows += width
            if n:
                ss = self._slice(seq, n)
                branching = branching or (ss.sample and width > 1)
                picked.append(ss)
                budget -= n
        return budget, branching

    def _slice(self, seq: Sequence, n: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        return ScheduledSequence(seq, start, n, start + n == end)

    def update(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: list[int],
        branch_steps: list[BranchStep] | tuple[BranchStep, ...] = (),
    ) -> list[Sequence]:
        """Apply a computed step: advance sequences, append sampled tokens, finish the done ones.

        ``sampled_token_ids`` holds one id per scheduled sequence with ``sample=True``, in batch
        order. Returns the sequences that finished in this step. The stop decisions on tokens
        are made here, once: a model EOS id (unless ``ignore_eos``) or a ``stop_token_ids`` id
        finishes with STOP (``stop_token_id`` set), then ``Sequence.is_last_by_length`` with
        LENGTH; a stop id does not stop a sequence before it has more than
        ``SamplingParams.min_tokens`` outputs (such ids are masked before sampling until
        then, so this is the guard). Post-processing reads ``finish_reason`` /
        ``stop_token_id``; it decides only what needs the text (stop strings, through
        ``finish``).

        ``branch_steps`` (the runner's, for requests with several sequences): a sample fork
        makes the other samples at their first token (each then stops on its own token); a
        beam step reorders the beams, and the search's end (``BranchStep.done``, decided by
        the beam rule of ``llmc.runtime.beam_search``) finishes them all.
        """
        seqs = batch.sequences
        branch_steps = branch_steps or ()
        if not branch_steps and len(seqs) >= self.vector_rows:  # decode rows over slots
            done = self._update_rows(batch, sampled_token_ids)
            if done is not None:
                return done
        n_sampled = sum(map(_SAMPLE, seqs))
        if len(sampled_token_ids) != n_sampled:
            raise ValueError(
                f"step {batch.step_id} sampled {n_sampled} sequences but "
                f"{len(sampled_token_ids)} token ids were given"
            )
        forks = {b.request_id: b for b in branch_steps}
        finished: list[Sequence] = []
        slots = self.slots
        tokens = iter(sampled_token_ids)
        pre = batch.prefix_rows  # a step with prompt chunks: its decode prefix at once
        if pre is not None and not branch_steps and self._prefix_current(seqs, pre):
            k = len(pre.seqs)
            finished = self._apply_rows(pre, sampled_token_ids[:k])
            tokens = itertools.islice(tokens, k, None)
            seqs = seqs[k:]
        tpb = self.kv.tokens_per_block
        reuse = self.kv.enable_block_reuse
        running = SequenceStatus.RUNNING
        last_sp: Any = None
        stops: frozenset[int] = frozenset()
        for ss in seqs:
            seq = ss.seq
            token = next(tokens) if ss.sample else None
            if seq.status is not running:
                continue  # finished (cancelled) between schedule() and update()
            before = seq.num_computed_tokens
            if before != ss.start_position:
                raise RuntimeError(
                    f"request {seq.request_id}: step {batch.step_id} is stale (computed "
                    f"{before} tokens, step started at {ss.start_position})"
                )
            after = seq.num_computed_tokens = before + ss.num_new_tokens
            if reuse and after // tpb != before // tpb:  # a block filled up in this step
                self.kv.register_full_blocks(seq)
            if token is None:
                slots.advance(seq)
                continue
            g = seq.group
            if g is not None and (g.beam or not g.forked):
                if g.beam:
                    continue  # its tokens are the beam step's (below)
                if seq.request_id not in forks:
                    raise RuntimeError(
                        f"step {batch.step_id}: request {seq.request_id}'s first token forks "
                        f"its {g.width} samples but the runner gave no BranchStep (runner bug)"
                    )
                finished += self._fork_samples(seq, forks[seq.request_id])
            token = int(token)
            out = seq.output_token_ids
            out.append(token)
            slots.advance(seq)
            if seq.sampling is not last_sp:  # consecutive rows often share one params object
                last_sp = seq.sampling
                stops = self._stop_ids(last_sp)
            reason = self._token_stop(seq, token, stops)
            if reason is None:
                continue  # most tokens end nothing
            self._running.remove(seq)
            self._finish(seq, reason)
            finished.append(seq)
        for step in branch_steps:
            first = self._seqs.get(step.request_id)
            if first is not None and first.group is not None and first.group.beam:
                finished += self._apply_beam_step(first.group, step)
        return finished

    def _stop_ids(self, sp: Any) -> frozenset[int]:
        """Every id that ends a request with params ``sp`` (EOS unless ignore_eos, stop ids),
        cached by identity (the entry keeps ``sp`` alive, so its id is not reused)."""
        hit = self._stop_cache.get(id(sp))
        if hit is not None and hit[0] is sp:
            return hit[1]
        ids = stop_ids(sp, self._eos)
        if len(self._stop_cache) >= 4096:
            self._stop_cache.clear()
        self._stop_cache[id(sp)] = (sp, ids)
        return ids

    # ---------------------------------------------------------------- introspection
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, request_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._seqs.get(request_id)

    @property
    def running(self) -> tuple[Sequence, ...]:
        """Running sequences in service order (oldest / highest priority first)."""
        return tuple(self._running)

    def waiting(self) -> tuple[Sequence, ...]:
        """Waiting sequences in queue order."""
        return tuple(sorted(self._waiting.values(), key=self._key))

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_steps=self._step,
            num_scheduled_tokens=self._num_tokens,
            num_preemptions=self._num_preemptions,
            num_finished=self._num_finished,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            peak_running=self._peak_running,
        )
