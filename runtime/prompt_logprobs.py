"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): which rows of a step score
which prompt tokens, their lm_head in slices of the logits workspace, and the entries.

A request with ``prompt_logprobs = k`` gets, for every prompt token ``i >= 1``, the
log-probability of ``prompt[i]`` given ``prompt[:i]`` from the raw logits of the row at
position ``i - 1`` (float32 ``log_softmax``: no temperature, penalties or filters, as vLLM's
default ``raw_logprobs``), the token's rank (vLLM's: the number of vocabulary entries whose
logprob is >= its own, so 1 = the most likely) and the ``k`` most likely tokens there. Token
0 has no prefix: its entry is None.

Rows (``prompt_rows``, host side, while the step is staged): every computed row of such a
request at a position ``p < len(prompt) - 1`` scores prompt token ``p + 1``, so each chunk of
a chunked prefill scores its own rows; the row of the last prompt token predicts the first
generated token and stays the sampler's. Its flat row indices and target ids ride in the
step's one host→device copy (``step_inputs``).

Device side: ``ModelRunner.forward`` gathers the scored rows' final hidden states after the
final norm (``[P, hidden]`` in the model dtype, the one allocation of such a step: a
``2 * vocab / hidden`` fraction of ``[P, vocab]`` float32 logits). After the sampled rows are
done with the logits workspace, ``score`` runs lm_head over ``max_batch_size`` rows at a time
into that planned ``logits`` buffer ``[max_batch_size, vocab]`` float32 and reduces each slice
at once (log_softmax in place, the target's logprob and rank, top-k) into one packed
``[P, 2 + 2k]`` float64 tensor, read back in one device→host copy. No ``[max_num_tokens,
vocab]`` buffer exists at any time.

Invariants: a request with prompt logprobs shares no cached prefix blocks
(``KVCacheManager._lookup_prefix``), so every scored position is computed by some step; a
preempted request recomputes its rows and their entries are written again (same values).
Prompt-logprob rows are never sampled rows (``sample`` is False for a chunk that ends before
the prompt's last token), so decode-only steps, CUDA graphs and async scheduling never see
them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from llmc.runtime.logprobs import PromptLogprob
from llmc.runtime.types import RequestFault, ScheduledSequence, Sequence

_WANTS = operator.attrgetter("seq.sampling.prompt_logprobs")


@dataclass(frozen=True)
class PromptSpan:
    """Consecutive prompt entries of one request computed by one step: ``entries[j]`` is the
    entry of prompt token ``first + j``."""

    request_id: int
    first: int
    entries: tuple[PromptLogprob, ...]


@dataclass
class PromptRows:
    """The rows of one step that score prompt tokens, in row order."""

    spans: list[tuple[Sequence, int, int]]
    """(sequence, first prompt token scored, tokens scored) per scoring chunk."""
    rows: list[int]
    """Flat row index (in the step's flattened order) of each scored token's prefix row."""
    targets: list[int]
    """The scored prompt token of each row."""
    num_top: int
    """The largest ``k`` of the step's requests (the packed width)."""
    index: torch.Tensor | None = None
    """``rows`` on the device [P] int64 (a staged section)."""
    target_ids: torch.Tensor | None = None
    """``targets`` on the device [P] int64 (a staged section)."""
    hidden: torch.Tensor | None = None
    """The rows' final hidden states [P, hidden], gathered by ``ModelRunner.forward``."""


def prompt_rows(order: Seq[ScheduledSequence], starts: Seq[int]) -> PromptRows | None:
    """The scored rows of a step whose sequences ``order`` start at flat rows ``starts``;
    None when no row scores a prompt token (the common case: one C-level pass)."""
    if set(map(_WANTS, order)) == {None}:
        return None
    spans: list[tuple[Sequence, int, int]] = []
    rows: list[int] = []
    targets: list[int] = []
    num_top = 0
    for s, r0 in zip(order, starts, strict=False):
        k = s.seq.sampling.prompt_logprobs
        if k is None:
            continue
        prompt, a = s.seq.prompt_token_ids, s.start_position
        m = min(a + s.num_new_tokens, len(prompt) - 1) - a
        if m <= 0:  # a decode row or the prompt's last token: the sampler's
            continue
        spans.append((s.seq, a + 1, m))
        rows.extend(range(r0, r0 + m))
        targets.extend(prompt[a + 1 : a + 1 + m])
        num_top = max(num_top, k)
    if not rows:
        return None
    return PromptRows(spans, rows, targets, num_top)


def score(
    backend: Any, prompt: PromptRows, lm_head: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """The packed entries [P, 2 + 2k] float64 on the host: logprob, rank, top ids, top
    logprobs; lm_head over ``logits.shape[0]`` rows at a time into ``logits`` (the planned
    workspace, whose rows are free once the step's sampled rows are done with them)."""
    hidden, target = prompt.hidden, prompt.target_ids
    assert hidden is not None and target is not None
    n, k = hidden.shape[0], min(prompt.num_top, logits.shape[1])
    cap = logits.shape[0]
    packed = torch.empty(n, 2 + 2 * k, dtype=torch.float64, device=hidden.device)
    for a in range(0, n, cap):
        b = min(a + cap, n)
        lp = logits[: b - a]
        backend.linear(hidden[a:b], lm_head, out=lp)
        lp.sub_(torch.logsumexp(lp, dim=-1, keepdim=True))  # log_softmax in place, float32
        chosen = lp.gather(1, target[a:b, None])
        packed[a:b, 0:1] = chosen
        packed[a:b, 1] = (lp >= chosen).sum(dim=-1)
        if k:
            top = lp.topk(k, dim=-1)
            packed[a:b, 2 : 2 + k] = top.indices
            packed[a:b, 2 + k :] = top.values
    return packed.cpu()


def unpack(prompt: PromptRows, packed: list[list[float]]) -> list[PromptSpan]:
    """Host rows of ``score`` → one PromptSpan per scoring chunk, each request's own ``k``
    (a request whose entries cannot be built fails alone: RequestFault)."""
    out: list[PromptSpan] = []
    width = (len(packed[0]) - 2) // 2 if packed else 0
    row = 0
    for seq, first, m in prompt.spans:
        try:
            k = min(seq.sampling.prompt_logprobs, width)
            entries = tuple(
                PromptLogprob(
                    token_id=int(prompt.targets[row + j]),
                    logprob=float(r[0]),
                    rank=int(r[1]),
                    top={int(r[2 + i]): float(r[2 + width + i]) for i in range(k)},
                )
                for j, r in enumerate(packed[row : row + m])
            )
        except Exception as e:  # this request's entries only
            raise RequestFault.caused(seq.request_id, "unpacking its prompt logprobs", e) from e
        out.append(PromptSpan(seq.request_id, first, entries))
        row += m
    return out
