"""The runner's work for requests with several sequences: the fork's samples and beam search.

A step whose batch is ``branching`` (``ScheduledBatch``) samples here instead of the plain
path of ``ModelRunner``:

- **Sample fork.** The row of a request with ``n`` / ``best_of`` samples that samples its
  first token is expanded into ``width`` rows of the same logits, row ``i`` drawing from
  sample ``i``'s seed stream (``sampling.branch_seed``); row 0's token is the row's id as
  usual, the others become the ``BranchStep`` that forks the other samples
  (``Scheduler.update``).
- **Beam step** (transformers' ``_beam_search`` and TensorRT-LLM's semantics, greedy): per
  beam group, on the device, ``log_softmax`` of its rows' logits (float32) plus each beam's
  running score, flattened over ``beams x vocab``, and the top ``max(2, 1 + #stop ids) *
  width`` candidates (one device→host copy for every group of the step). On the host
  (``select_beams``): the best ``width`` candidates that do not end a beam continue; of the
  first ``width`` candidates, those that end one (a stop id, or the length limit) join the
  finished beams, scored ``logprob_sum / generated_len ** length_penalty``, the best
  ``width`` kept; the search ends when no running beam can beat the worst finished one
  (``early_stopping``: see ``SamplingParams``), when ``early_stopping=True`` and ``width``
  beams finished, or when every candidate ended. The first step of a group (its prompt's
  last token) has one row: every beam starts from it.

Invariants: nothing here changes a Sequence or a SequenceGroup (the Scheduler applies the
BranchSteps); token ids are returned one per sampled row in the batch's order (a beam row's
is its greedy token, which ``update`` ignores); a row's sample depends only on its seed
stream, offset and logits, as in the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from llmc.runtime import sampling as smp
from llmc.runtime.branches import BeamHypothesis, BranchStep, SequenceGroup
from llmc.runtime.types import FinishReason, ScheduledSequence, Sequence

_NEG = -1.0e9
"""transformers' score of a candidate that may not continue (it ended its beam)."""


def fork_width(seq: Sequence) -> int:
    """Rows the sampler draws for ``seq`` this step: its request's samples at the fork
    (the first token of a request with several samples), else 1."""
    g = seq.group
    if g is None or g.forked or g.beam:
        return 1
    return g.width


def branch_sample(
    backend: Any, logits: torch.Tensor, sampled: Seq[ScheduledSequence], vocab_size: int
) -> tuple[list[int], list[smp.TokenLogprobs | None] | None, list[BranchStep]]:
    """Sample a branching step's rows ``logits`` [S, V] (row ``r`` for ``sampled[r]``).

    Returns (token ids, per-row TokenLogprobs or None, the step's BranchSteps)."""
    seqs = [ss.seq for ss in sampled]
    smp.apply_logit_bias(logits, sampled)  # beams are scored, forks sampled, with the bias
    steps = beam_steps(logits, seqs)  # before sampling: it reads the (biased) raw logits
    widths = [fork_width(s) for s in seqs]
    rows = [r for r, w in enumerate(widths) for _ in range(w)]
    expanded = [seqs[r] for r in rows]
    branches = [i for w in widths for i in range(w)]
    if len(rows) != len(seqs):
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        logits = logits.index_select(0, index)
    smp.suppress_stop_ids(logits, [sampled[r] for r in rows])  # min_tokens, as the plain path
    meta = smp.metadata_for(expanded, vocab_size, logits.device, branches=branches)
    ids = backend.sample(logits, meta)
    lps: list[smp.TokenLogprobs | None] | None = None
    if meta.num_logprobs is not None:
        packed = smp.logprob_tensor(logits, meta, ids, meta.num_logprobs).cpu().tolist()
        flat = [int(row[0]) for row in packed]
        lps = smp.unpack_logprobs(packed, expanded)
    else:
        flat = [int(t) for t in ids.tolist()]
    token_ids: list[int] = []
    row_lps: list[smp.TokenLogprobs | None] = []
    at = 0
    for seq, w in zip(seqs, widths, strict=True):
        token_ids.append(flat[at])
        row_lps.append(lps[at] if lps else None)
        if w > 1:
            steps.append(
                BranchStep(
                    request_id=seq.request_id,
                    parents=(0,) * (w - 1),
                    token_ids=tuple(flat[at + 1 : at + w]),
                    logprobs=tuple(lps[at + 1 : at + w]) if lps else (None,) * (w - 1),
                )
            )
        at += w
    return token_ids, (row_lps if lps else None), steps


def beam_steps(logits: torch.Tensor, seqs: Seq[Sequence]) -> list[BranchStep]:
    """The BranchStep of every beam group whose rows are in ``seqs`` (rows of ``logits``).

    The device work of all groups is packed into one tensor and read back with one copy."""
    groups: dict[int, tuple[SequenceGroup, list[tuple[int, Sequence]]]] = {}
    for r, seq in enumerate(seqs):
        g = seq.group
        if g is not None and g.beam:
            groups.setdefault(id(g), (g, []))[1].append((r, seq))
    if not groups:
        return []
    parts, plans = [], []
    vocab = logits.shape[1]
    for g, rows in groups.values():
        rows.sort(key=lambda x: x[1].branch)  # beam scores and parents are by branch
        index = torch.tensor([r for r, _ in rows], dtype=torch.int64, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        scores = g.beam_scores if g.forked else [0.0]
        if len(scores) != len(rows):
            raise RuntimeError(
                f"request {rows[0][1].request_id}: {len(rows)} beam rows for "
                f"{len(scores)} beam scores (the group's rows must run together)"
            )
        total = lp + torch.tensor(scores, dtype=torch.float32, device=lp.device)[:, None]
        n_cand = min(max(2, 1 + len(g.stop_ids)) * g.width, total.numel())
        top = total.view(-1).topk(n_cand)
        parts += [top.values.double(), top.indices.double()]
        plans.append((g, [s for _, s in rows], n_cand))
    host = torch.cat(parts).cpu().tolist()  # one device→host copy for the step's groups
    steps, at = [], 0
    for g, beams, n in plans:
        values, indices = host[at : at + n], host[at + n : at + 2 * n]
        at += 2 * n
        cands = [(v, int(i) // vocab, int(i) % vocab) for v, i in zip(values, indices, strict=True)]
        steps.append(select_beams(g, beams, cands))
    return steps


def select_beams(
    g: SequenceGroup, beams: list[Sequence], cands: list[tuple[float, int, int]]
) -> BranchStep:
    """transformers' beam update on the host, from one group's candidates ``(summed logprob,
    row of ``beams``, token)`` best first (see the module docstring)."""
    sp = beams[0].sampling
    k, penalty, early = g.width, sp.length_penalty, sp.early_stopping
    generated = len(beams[0].output_token_ids) + 1  # with this step's token
    at_limit = beams[0].is_last_by_length(generated)
    ends = [tok in g.stop_ids or at_limit for _, _, tok in cands]
    masked = [v + (_NEG if e else 0.0) for (v, _, _), e in zip(cands, ends, strict=True)]
    order = sorted(range(len(cands)), key=lambda j: -masked[j])[:k]
    parents = tuple(beams[cands[j][1]].branch for j in order)
    tokens = tuple(cands[j][2] for j in order)
    scores = tuple(masked[j] for j in order)
    finished = list(g.finished)
    full = len(finished) == k
    if g.improvable and not (full and early is True):
        for j in range(min(k, len(cands))):
            if not ends[j]:
                continue
            v, row, tok = cands[j]
            reason = FinishReason.STOP if tok in g.stop_ids else FinishReason.LENGTH
            ids = (*beams[row].output_token_ids, tok)
            finished.append(BeamHypothesis(ids, v, v / generated**penalty, reason))
        finished.sort(key=lambda h: -h.score)
        del finished[k:]
    improvable = g.improvable
    if improvable:
        hypothetical = beams[0].max_new_tokens if early == "never" and penalty > 0 else generated
        worst = min(h.score for h in finished) if len(finished) == k else _NEG
        improvable = scores[0] / hypothetical**penalty > worst
    done = not improvable or (len(finished) == k and early is True) or all(ends)
    return BranchStep(
        request_id=beams[0].request_id,
        parents=parents,
        token_ids=tokens,
        beam_scores=scores,
        finished=tuple(finished),
        improvable=improvable,
        done=done,
    )
