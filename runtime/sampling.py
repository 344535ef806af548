"""Per-step sampling inputs from the scheduled sequences, and log-probabilities.

The ModelRunner samples one row per ScheduledSequence with ``sample=True``. This module
turns those sequences into the per-row columns of ``SamplingMetadata`` (host lists that the
runner stages into its single host→device copy), builds the penalty count tensors when a
row needs them, and computes log-probabilities of the sampled tokens.

Invariants:
- A row's seed is its request's ``SamplingParams.seed`` or, when None, a seed derived from
  the request id (``derived_seed``); sample ``i > 0`` of a request with several
  (``Sequence.branch``) draws from ``branch_seed(seed, i)``. The RNG offset is the number
  of output tokens the sequence already has. A row's token thus depends only on (seed,
  branch, offset, its logits), never on the other rows of the batch.
- Seeds are taken modulo 2**64 and stored as the int64 with the same bits.
- Penalty tensors exist only when some row has a non-neutral penalty (the common case costs
  nothing); rows without penalties keep zero counts, which leaves their logits unchanged.
- ``min_tokens``: a row's stop ids are masked to -inf in its logits before sampling
  (``suppress_stop_ids``) while it has fewer outputs than that; the sampler is untouched.
- Log-probabilities are ``log_softmax`` of the *processed* logits each row samples from
  (``llmc.cuda.reference.process_logits``: penalties, temperature, top-k/p, min-p; greedy
  rows: penalties only), so a filtered-out token has logprob -inf.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence as Seq

import torch

from llmc.cuda import reference as ref
from llmc.cuda.backend import SamplingMetadata
from llmc.runtime.logprobs import TokenLogprobs
from llmc.runtime.types import (
    RequestFault,
    SamplingParams,
    ScheduledSequence,
    Sequence,
    row_fault,
)

U64 = (1 << 64) - 1

INT64_COLUMNS = ("seeds", "offsets")
INT32_COLUMNS = ("top_k",)
FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
COLUMN_DTYPES = {
    **dict.fromkeys(INT64_COLUMNS, "int64"),
    **dict.fromkeys(INT32_COLUMNS, "int32"),
    **dict.fromkeys(FLOAT_COLUMNS, "float32"),
}
"""Each sampling column's staged dtype, in SamplingMetadata's section order."""


def _to_int64(x: int) -> int:
    x &= U64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """Vigna's SplitMix64 output function of ``x`` (a uint64 as a Python int)."""
    z = (x + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=8192)
def derived_seed(request_id: int) -> int:
    """The seed of a request that gave none: splitmix64(request_id), as an int64."""
    return _to_int64(splitmix64(request_id & U64))


def row_seed(seq: Sequence, branch: int | None = None) -> int:
    """The int64 seed of one sequence's sampling stream (``branch``: that sample's of the
    sequence's request; default the sequence's own, ``Sequence.branch``)."""
    s = seq.sampling.seed
    base = _seed64(s) if s is not None else derived_seed(seq.request_id)
    b = seq.branch if branch is None else branch
    return branch_seed(base, b) if b else base


def branch_seed(seed: int, branch: int) -> int:
    """The seed of sample ``branch`` (> 0) of a request seeded ``seed`` (an int64): mixed
    by SplitMix64, so neighbouring seeds and branches give unrelated streams."""
    return _to_int64(splitmix64((seed & U64) ^ splitmix64(branch)))


@functools.lru_cache(maxsize=1024)
def _seed64(seed: int) -> int:
    return _to_int64(seed)


_CONST_COLUMNS = ("top_k", *FLOAT_COLUMNS)
"""Columns that depend on the SamplingParams only (not on the request id or the step)."""


_ROWS_BY_ID: dict[int, tuple[SamplingParams, tuple]] = {}


def _const_row(p: SamplingParams) -> tuple:
    """The constant columns of ``p``, cached by object identity (the params object is kept
    in the cache entry, so its id cannot be reused while the entry lives)."""
    hit = _ROWS_BY_ID.get(id(p))
    if hit is not None and hit[0] is p:
        return hit[1]
    row = _make_row(p)
    if len(_ROWS_BY_ID) >= 4096:
        _ROWS_BY_ID.clear()
    _ROWS_BY_ID[id(p)] = (p, row)
    return row


def _make_row(p: SamplingParams) -> tuple:
    return (
        p.top_k,
        p.temperature,
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    )


def row_columns(seq: Sequence) -> tuple[int, tuple]:
    """(seed, constant columns) of one sequence's sampling row."""
    return row_seed(seq), _const_row(seq.sampling)


def sampling_columns(
    seqs: Seq[Sequence], offset_extra: int = 0, branches: Seq[int] | None = None
) -> dict[str, list]:
    """Per-row host columns of SamplingMetadata, keyed by its field names.

    ``offset_extra``: tokens each row has sampled beyond its ``output_token_ids`` (1 when
    the step is scheduled before the previous step's tokens are known: async scheduling).
    ``branches``: each row's sample index when it is not its sequence's own (the rows of a
    fork draw the other samples' first tokens from the forking sequence's logits).
    """
    try:
        if branches is None:
            seeds = [row_seed(seq) for seq in seqs]
        else:
            seeds = [row_seed(seq, b) for seq, b in zip(seqs, branches, strict=True)]
        consts = [_const_row(seq.sampling) for seq in seqs]
    except Exception as e:  # one request's params broke the columns: name it (RequestFault)
        fault = row_fault(seqs, row_columns, "building its sampling columns")
        if fault is None:
            raise
        raise fault from e
    cols: dict[str, list] = {
        "seeds": seeds,
        "offsets": [len(seq.output_token_ids) + offset_extra for seq in seqs],
    }
    if consts:
        for name, col in zip(_CONST_COLUMNS, zip(*consts, strict=True), strict=True):
            cols[name] = list(col)
    else:
        cols.update({name: [] for name in _CONST_COLUMNS})
    return cols


def penalty_tensors(
    seqs: Seq[Sequence], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output_counts [S, V] int32, prompt_mask [S, V] bool), or None when no row needs them.

    Built on the device from one flat index list (one extra host→device copy, only on
    steps where a row uses a penalty).
    """
    if not any(s.sampling.uses_penalties for s in seqs):
        return None
    out_idx: list[int] = []
    prompt_idx: list[int] = []
    for row, seq in enumerate(seqs):
        if not seq.sampling.uses_penalties:
            continue
        base = row * vocab_size
        out_idx.extend(base + t for t in seq.output_token_ids)
        prompt_idx.extend(base + t for t in seq.prompt_token_ids)
    idx = torch.tensor(out_idx + prompt_idx, dtype=torch.int64).to(device, non_blocking=True)
    n = len(seqs) * vocab_size
    counts = torch.zeros(n, dtype=torch.int32, device=device)
    counts.index_add_(
        0, idx[: len(out_idx)], torch.ones_like(idx[: len(out_idx)], dtype=torch.int32)
    )
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[idx[len(out_idx) :]] = True
    return counts.view(-1, vocab_size), mask.view(-1, vocab_size)


def build_metadata(
    columns: dict[str, torch.Tensor],
    seqs: Seq[Sequence],
    vocab_size: int,
    device: torch.device,
    all_plain: bool = False,
    all_greedy: bool | None = None,
) -> SamplingMetadata:
    """SamplingMetadata from device column tensors (``sampling_columns`` staged) + sequences.
    ``all_plain``: the caller knows every row's params are ``is_plain`` (no penalties, no
    logprobs): their per-row checks are skipped. ``all_greedy``: whether every row is
    greedy, when the caller knows (from its staged temperature column), else asked of
    each row."""
    pen = None if all_plain else penalty_tensors(seqs, vocab_size, device)
    # best_of > n ranks samples by logprob: its rows need the token's own (0 alternatives)
    requested = (
        [] if all_plain else [s.sampling.logprobs or 0 for s in seqs if s.sampling.token_logprobs]
    )
    return SamplingMetadata(
        temperature=columns["temperature"],
        top_k=columns["top_k"],
        top_p=columns["top_p"],
        min_p=columns["min_p"],
        seeds=columns["seeds"],
        offsets=columns["offsets"],
        repetition_penalty=columns["repetition_penalty"],
        presence_penalty=columns["presence_penalty"],
        frequency_penalty=columns["frequency_penalty"],
        output_counts=pen[0] if pen else None,
        prompt_mask=pen[1] if pen else None,
        all_greedy=all(s.sampling.greedy for s in seqs) if all_greedy is None else all_greedy,
        num_logprobs=max(requested) if requested else None,
    )


def metadata_for(
    seqs: Seq[Sequence],
    vocab_size: int,
    device: torch.device | str = "cpu",
    branches: Seq[int] | None = None,
) -> SamplingMetadata:
    """SamplingMetadata of ``seqs`` built directly (no staging): for tests, tools and the
    rare steps that fork or rescore rows (``llmc.runtime.beam_search``); ``branches`` as in
    ``sampling_columns``."""
    cols = sampling_columns(seqs, branches=branches)
    tensors = {
        n: torch.tensor(v, dtype=getattr(torch, COLUMN_DTYPES[n]), device=device)
        for n, v in cols.items()
    }
    return build_metadata(tensors, seqs, vocab_size, torch.device(device))


_SUPPRESSES = operator.attrgetter("seq.suppressed_ids")


_BIASED = operator.attrgetter("seq.sampling.logit_bias")


def apply_logit_bias(logits: torch.Tensor, rows_of: Seq[ScheduledSequence]) -> None:
    """``logit_bias``: add each row's biases to its logits, in place, before the sampler (any
    backend's, unchanged) and before ``suppress_stop_ids`` (a suppressed id stays -inf).
    ``logits``: [S, vocab] float, row ``r`` sampled for ``rows_of[r]``; the ids were checked
    against the vocabulary at admission. One C-level pass when no row asks."""
    if not any(map(_BIASED, rows_of)):
        return
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for r, ss in enumerate(rows_of):
        for tid, bias in ss.seq.sampling.logit_bias:
            rows.append(r)
            cols.append(tid)
            vals.append(bias)
    index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)
    add = torch.tensor(vals, dtype=torch.float32).to(logits.device, logits.dtype)
    logits.index_put_((index[0], index[1]), add, accumulate=True)


def suppress_stop_ids(logits: torch.Tensor, rows_of: Seq[ScheduledSequence]) -> None:
    """``min_tokens``: set to -inf, in place, the logits of the ids that would stop a row
    (``Sequence.suppressed_ids``: EOS and stop ids) while its sequence has fewer than
    ``min_tokens`` outputs, so that the sampler (any backend's, unchanged) cannot pick them.
    ``logits``: [S, vocab], row ``r`` sampled for ``rows_of[r]``. One C-level pass when no
    row asks."""
    if not any(map(_SUPPRESSES, rows_of)):
        return
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for r, seq in enumerate(ss.seq for ss in rows_of):
        if seq.suppressed_ids and len(seq.output_token_ids) < seq.sampling.min_tokens:
            ids = [t for t in seq.suppressed_ids if t < vocab]
            rows.extend([r] * len(ids))
            cols.extend(ids)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)
        logits[index[0], index[1]] = float("-inf")


def logprob_tensor(
    logits: torch.Tensor, meta: SamplingMetadata, ids: torch.Tensor, num_top: int
) -> torch.Tensor:
    """[S, 3 + 2 * num_top] float64 on the device: id, its logprob, its rank, top ids, top
    logprobs. The rank is vLLM's: the number of tokens whose logprob is >= the chosen one's.

    Packed in one tensor so that ids and logprobs come back in one device→host copy (ids
    and ranks are exact in float64).
    """
    lp = torch.log_softmax(ref.process_logits(logits, meta), dim=-1)
    chosen = lp.gather(1, ids[:, None])
    rank = (lp >= chosen).sum(dim=-1, keepdim=True)
    top = lp.topk(min(num_top, lp.shape[1]), dim=-1)
    parts = [ids[:, None], chosen, rank, top.indices, top.values]
    return torch.cat([p.double() for p in parts], dim=1)


def unpack_logprobs(packed: list[list[float]], seqs: Seq[Sequence]) -> list[TokenLogprobs | None]:
    """Host rows of ``logprob_tensor`` → per-row TokenLogprobs (None where not needed:
    ``SamplingParams.token_logprobs``)."""
    result: list[TokenLogprobs | None] = []
    for row, seq in zip(packed, seqs, strict=True):
        if not seq.sampling.token_logprobs:
            result.append(None)
            continue
        n = seq.sampling.logprobs or 0
        try:
            width = (len(row) - 3) // 2
            top = tuple((int(row[3 + j]), float(row[3 + width + j])) for j in range(min(n, width)))
            result.append(
                TokenLogprobs(
                    token_id=int(row[0]), logprob=float(row[1]), top=top, rank=int(row[2])
                )
            )
        except Exception as e:  # this request's logprobs only
            raise RequestFault.caused(seq.request_id, "unpacking its logprobs", e) from e
    return result
