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

Stop decisions: ``update`` decides every stop that the tokens show (EOS, stop token ids,
length; see there) and records it on the Sequence (``finish_reason``, ``stop_token_id``);
``finish`` applies the ones decided outside (cancel, stop string). Nobody re-derives them.

``SchedulerConfig``, ``SchedulerStats``, the policy names and the per-request admission checks
live in ``llmc.runtime.admission`` and are re-exported here.
"""

from __future__ import annotations

import bisect
import heapq
import logging
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
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.types import (
    FinishReason,
    ScheduledBatch,
    ScheduledSequence,
    Sequence,
    SequenceStatus,
)

logger = logging.getLogger("llmc.scheduler")

_new = object.__new__
_SAMPLE = operator.attrgetter("sample")


def decode_slice(seq: Sequence, start: int) -> ScheduledSequence:
    """``ScheduledSequence(seq, start, 1, True)`` built without the frozen dataclass's
    per-field ``object.__setattr__`` (half the cost; one per decode row per step)."""
    ss = _new(ScheduledSequence)
    d = ss.__dict__
    d["seq"] = seq
    d["start_position"] = start
    d["num_new_tokens"] = 1
    d["sample"] = True
    return ss


class Scheduler:
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
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._order: dict[int, int] = {}  # arrival number per request id
        self._arrivals = 0
        self._waiting: dict[int, Sequence] = {}
        self._heap: list[tuple[int, int, int]] = []  # (-priority, arrival, id); lazy deletion
        self._running: list[Sequence] = []  # sorted by queue key
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
        self._waiting[seq.request_id] = seq
        heapq.heappush(self._heap, (*self._key(seq), seq.request_id))

    def _peek_waiting(self) -> Sequence | None:
        while self._heap:
            seq = self._waiting.get(self._heap[0][2])
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
        self._seqs[rid] = seq
        self._order[rid] = self._arrivals
        self._arrivals += 1
        self._push_waiting(seq)

    def finish(self, request_id: int, reason: FinishReason) -> Sequence | None:
        """End an unfinished request now, for a reason decided outside the scheduler (a
        cancel; a stop string, which only the detokenized text shows); returns it, or None
        if unknown. Frees its blocks whether it is waiting or running.
        """
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if self._waiting.pop(request_id, None) is None:
            self._running.remove(seq)
        self._finish(seq, reason)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.request_id]
        del self._order[seq.request_id]
        self._num_finished += 1

    def _preempt(self, seq: Sequence) -> None:
        dropped = seq.num_computed_tokens
        self.kv.free(seq)
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

    # ---------------------------------------------------------------- the step
    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens; allocates their KV blocks (and may preempt)."""
        cfg, kv = self.limits, self.kv
        budget = cfg.max_num_tokens
        picked: list[ScheduledSequence] = []
        preempted: list[int] = []

        tpb = kv.tokens_per_block

        # 1. Running sequences, in queue order; the newest is preempted when blocks run out.
        decode: list[ScheduledSequence] = []  # ScheduledSequence.is_decode, decided here
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            start = seq.num_computed_tokens
            n_prompt = len(seq.prompt_token_ids)
            left = n_prompt + len(seq.output_token_ids) - start
            if left == 1 and start < len(seq.block_table) * tpb:  # its block is there already
                ss = decode_slice(seq, start)
                (decode if start >= n_prompt else picked).append(ss)
                budget -= 1
                i += 1
                continue
            n = min(left, budget)
            scheduled = True
            while not kv.append_slots(seq, n):
                if self._no_evict:
                    raise RuntimeError(
                        f"guaranteed_no_evict: request {seq.request_id} found no free block "
                        "although its blocks were reserved at admission (scheduler bug)"
                    )
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    scheduled = False
                    break
            if scheduled:
                ss = self._slice(seq, n)
                (decode if n == 1 and start >= n_prompt else picked).append(ss)
                budget -= n
                i += 1

        # 2. Waiting sequences, in queue order, until one does not fit.
        reserved: int | None = None  # computed once, when a waiting sequence is looked at
        while not preempted and budget > 0 and len(self._running) < cfg.max_batch_size:
            seq = self._peek_waiting()
            if seq is None:
                break
            if reserved is None:
                reserved = self._reserved_blocks() if self._no_evict else 0
            cached = kv.cached_prefix_tokens(seq)
            remaining = seq.num_tokens - cached
            n = min(remaining, budget)
            # Without chunked prefill a prompt waits for a step with room for all of it; only
            # a preempted sequence longer than a whole step (prompt + outputs) is chunked.
            if n < remaining and not cfg.enable_chunked_prefill and remaining <= cfg.max_num_tokens:
                break
            if self._no_evict:
                life = kv.num_blocks_needed(seq, kv_tokens_needed(seq) - cached)
                if life > kv.num_free_blocks - reserved:
                    break
            elif not kv.can_allocate(seq, n):
                break
            del self._waiting[seq.request_id]
            heapq.heappop(self._heap)
            kv.allocate_prefix(seq)
            if not kv.append_slots(seq, n):
                raise RuntimeError(f"request {seq.request_id}: admission check was wrong")
            if self._no_evict:
                total = kv.blocks_for_tokens(kv_tokens_needed(seq))
                reserved += total - len(seq.block_table)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=self._key)
            picked.append(self._slice(seq, n))
            budget -= n

        self._step += 1
        self._num_tokens += cfg.max_num_tokens - budget
        self._peak_running = max(self._peak_running, len(self._running))
        prefill: list[ScheduledSequence] = []
        for s in picked:  # ScheduledSequence.is_decode, inlined
            if s.num_new_tokens == 1 and s.start_position >= len(s.seq.prompt_token_ids):
                decode.append(s)
            else:
                prefill.append(s)
        return ScheduledBatch(
            step_id=self._step - 1,
            sequences=tuple(decode + prefill) if prefill else tuple(decode),
            preempted_request_ids=tuple(preempted),
        )

    def schedule_ahead(self, prev: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step, scheduled while ``prev`` runs (async scheduling), or None.

        ``prev`` has been scheduled but not yet ``update``d: its sampled tokens are unknown,
        and each of its sampled sequences gets its next token computed from that unknown
        token (the runner takes it from the device). Returns None, and changes nothing, when
        this step needs the host to know ``prev``'s outcome first: a running sequence that
        ``prev`` does not sample (a prefill chunk is pending or the budget skipped it), a
        waiting sequence that could be admitted (free batch slot), too few free blocks (no
        preemption here), or nothing left to decode. A sequence whose ``prev`` token is its
        last by length (``Sequence.is_last_by_length``) is left out; one that then stops on
        EOS / a stop token / a stop string has its extra token discarded by ``update``
        (it is no longer running) and its blocks were already freed by ``finish``.
        """
        cfg, kv = self.limits, self.kv
        tpb = kv.tokens_per_block
        running = self._running
        if not running or (self._waiting and len(running) < cfg.max_batch_size):
            return None
        prev_rows = [ss for ss in prev.sequences if ss.sample]
        # the common case: prev sampled exactly the running sequences, in the same order
        if len(prev_rows) == len(running) and all(
            map(ScheduledSequence.is_row_of, prev_rows, running)
        ):
            pairs = zip(running, prev_rows, strict=True)
        else:
            sampled = {id(ss.seq): ss for ss in prev_rows}
            pairs = ((seq, sampled.get(id(seq))) for seq in running)
        picked: list[ScheduledSequence] = []
        grow: list[tuple[Sequence, int]] = []  # rows whose next token starts a new block
        need = 0
        for seq, ss in pairs:
            if ss is None or seq.num_computed_tokens != ss.start_position:
                return None
            if seq.is_last_by_length(len(seq.output_token_ids) + 1):  # prev's token ends it
                continue
            n_prev = ss.num_new_tokens
            start = ss.start_position + n_prev
            if start >= len(seq.block_table) * tpb:
                need += kv.num_blocks_needed(seq, n_prev + 1)  # a new block
                grow.append((seq, n_prev))
            picked.append(decode_slice(seq, start))
        if not picked or len(picked) > cfg.max_num_tokens or need > kv.num_free_blocks:
            return None
        for seq, n_prev in grow:
            if not kv.append_slots(seq, n_prev + 1):
                raise RuntimeError(f"request {seq.request_id}: block count was wrong (bug)")
        self._step += 1
        self._num_tokens += len(picked)
        return ScheduledBatch(step_id=self._step - 1, sequences=tuple(picked))

    def _slice(self, seq: Sequence, n: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        return ScheduledSequence(seq, start, n, start + n == end)

    def _reserved_blocks(self) -> int:
        """Blocks promised to running sequences but not allocated yet (guaranteed_no_evict)."""
        return sum(
            self.kv.blocks_for_tokens(kv_tokens_needed(s)) - len(s.block_table)
            for s in self._running
        )

    def update(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
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
        """
        seqs = batch.sequences
        n_sampled = sum(map(_SAMPLE, seqs))
        if len(sampled_token_ids) != n_sampled:
            raise ValueError(
                f"step {batch.step_id} sampled {n_sampled} sequences but "
                f"{len(sampled_token_ids)} token ids were given"
            )
        finished: list[Sequence] = []
        tokens = iter(sampled_token_ids)
        tpb = self.kv.tokens_per_block
        reuse = self.kv.enable_block_reuse
        running = SequenceStatus.RUNNING
        last_sp: Any = None
        stop_ids: frozenset[int] = frozenset()
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
                continue
            token = int(token)
            out = seq.output_token_ids
            out.append(token)
            if seq.sampling is not last_sp:  # consecutive rows often share one params object
                last_sp = seq.sampling
                stop_ids = self._stop_ids(last_sp)
            if token in stop_ids and len(out) > seq.sampling.min_tokens:
                seq.stop_token_id = token
                reason = FinishReason.STOP
            elif seq.is_last_by_length(len(out)):
                reason = FinishReason.LENGTH
            else:
                continue  # most tokens end nothing
            self._running.remove(seq)
            self._finish(seq, reason)
            finished.append(seq)
        return finished

    def _stop_ids(self, sp: Any) -> frozenset[int]:
        """Every id that ends a request with params ``sp`` (EOS unless ignore_eos, stop ids),
        cached by identity (the entry keeps ``sp`` alive, so its id is not reused)."""
        hit = self._stop_cache.get(id(sp))
        if hit is not None and hit[0] is sp:
            return hit[1]
        ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self._eos)
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
