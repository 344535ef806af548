"""The sequences of one request that decodes several at once (no torch).

A request with ``SamplingParams.num_branches > 1`` (n / best_of samples, or beams) has one
``SequenceGroup``. It prefills its prompt once as one sequence; the step that samples the
first token forks the others (a ``BranchStep``), which share its KV blocks (refcounts; the
partial last block is copied on its next write: ``KVCacheManager``). Samples then run as
independent sequences; beams stay in lockstep and every step reorders them
(``llmc.runtime.beam_search`` decides, ``Scheduler.update`` applies).

Invariants: a group's branches are indexed by ``Sequence.branch`` and listed in that order;
the Scheduler alone mutates a group (the runner reads it to plan its fork and beam work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmc.runtime.types import FinishReason, SamplingParams, Sequence, SequenceStatus


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request that decodes several at once (no torch).

    ``branches`` lists every sequence ever made for the request, by branch index; the first
    is the one the Executor created. Before the fork (``forked`` False) only it exists: it
    prefills the prompt once, and the step that samples its first token forks the others
    (``BranchStep``), which share its blocks. Samples (n / best_of) then run independently;
    beams stay in lockstep and are reordered by every step (``llmc.runtime.beam_search``).
    Mutated only by the Scheduler (and the KVCacheManager's fork)."""

    width: int
    beam: bool
    stop_ids: frozenset[int] = frozenset()
    """Ids that end a beam (EOS unless ignore_eos, stop token ids): the beam step's rule."""
    branches: list[Sequence] = field(default_factory=list)
    forked: bool = False
    beam_scores: list[float] = field(default_factory=list)
    """Beam search: the running beams' summed logprobs, by branch."""
    finished: list[BeamHypothesis] = field(default_factory=list)
    """Beam search: the best finished beams so far (at most ``width``), best first."""
    improvable: bool = True
    """Beam search: a running beam may still beat the worst finished one (transformers'
    early-stop heuristic; once False it stays False)."""

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.branches if s.status is not SequenceStatus.FINISHED]


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam: its output ids, summed logprob and length-penalized score."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


@dataclass(frozen=True)
class BranchStep:
    """What one step decided for a request with several sequences, beyond one token per
    row: the fork of its first token (samples or beams) or a beam reorder.

    New branch ``j`` continues the sequence that is branch ``parents[j]`` now (by branch
    index) with ``token_ids[j]``. A sample fork lists the new branches 1 .. width-1 (branch
    0 got its token in the step's ids as usual); a beam step lists every beam. Beam steps
    also carry the running scores, the finished beams and whether the search is done."""

    request_id: int
    parents: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[Any, ...] = ()
    """Sample fork: each new branch's ``TokenLogprobs`` (or None)."""
    beam_scores: tuple[float, ...] = ()
    finished: tuple[BeamHypothesis, ...] = ()
    improvable: bool = True
    done: bool = False


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: a thin alias of ``SamplingParams(use_beam_search=True,
    beam_width=..., n=beam_width)`` (every beam is returned, best first; ``LLM.beam_search``).
    Beam search here is greedy (``temperature`` must stay 0) and stops at the engine's EOS."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.sampling_params()  # the one home of the rules: a bad value is refused here

    def sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` this stands for (RequestError naming a bad field)."""
        return SamplingParams(
            max_new_tokens=self.max_tokens,
            use_beam_search=True,
            beam_width=self.beam_width,
            n=w if isinstance(w := self.beam_width, int) and w >= 1 else 1,  # beam_width named
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
