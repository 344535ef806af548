"""Random sampling batches for the sampling-kernel tests (GPU and host emulation).

``sampling_batch(s, v, filters, device, seed, logits=...)`` returns (logits [s, v]
float32, SamplingMetadata) with every row's parameters drawn from the named filter
combination, temperatures over a wide range, seeds and offsets over the full int64 /
2**40 ranges. Logit shapes (``LOGIT_KINDS``): Gaussian, coarse (many ties at every
threshold), with -inf entries (some rows masked all but one, one row fully masked) and
peaked (one dominant token, the rest far below: top-p keeps one or a few).
"""

from __future__ import annotations

import torch

from llmc.cuda.backend import SamplingMetadata

FILTERS = (
    "temperature", "top_k", "top_p", "min_p", "top_k+top_p", "top_k+min_p", "top_p+min_p",
    "top_k+top_p+min_p", "greedy", "mixed", "penalties",
)  # fmt: skip
LOGIT_KINDS = ("gauss", "ties", "masked", "peaked")


def random_logits(s: int, v: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """[s, v] float32 logits of one of ``LOGIT_KINDS`` (CPU)."""
    x = torch.randn(s, v, generator=g) * 3
    if kind == "ties":  # a coarse grid: thresholds fall inside runs of equal values
        x = (x * 2).round() / 2
        x[:, : min(v, 7)] = x.max()  # several maxima
    elif kind == "masked":
        x[torch.rand(s, v, generator=g) < 0.4] = float("-inf")
        if s > 1:
            x[1] = float("-inf")  # all masked: the first index
        if s > 2:
            x[2] = float("-inf")
            x[2, v // 2] = 0.5  # one token left
        x[:, 0] = torch.where(torch.rand(s, generator=g) < 0.5, float("-inf"), x[:, 0])
    elif kind == "peaked":
        x = x * 0.2
        x[torch.arange(s), torch.randint(0, v, (s,), generator=g)] = 12.0
    return x.float()


def _draw(n: int, values: list, g: torch.Generator) -> list:
    return [values[i] for i in torch.randint(0, len(values), (n,), generator=g).tolist()]


def sampling_batch(
    s: int, v: int, filters: str, device: torch.device | str, seed: int, kind: str = "gauss"
) -> tuple[torch.Tensor, SamplingMetadata]:
    """(logits, metadata) for ``filters`` (one of ``FILTERS``) on ``device``."""
    g = torch.Generator().manual_seed(seed)
    logits = random_logits(s, v, kind, g)
    temp = (torch.rand(s, generator=g) * 1.7 + 0.05).tolist()
    temp = [t if i % 5 else [1e-3, 0.7, 1.0, 2.0][(i // 5) % 4] for i, t in enumerate(temp)]
    top_k, top_p, min_p = [0] * s, [1.0] * s, [0.0] * s
    parts = set(filters.split("+"))
    if filters in ("mixed", "penalties"):
        parts = {"top_k", "top_p", "min_p"}
    if "top_k" in parts:
        top_k = _draw(s, [1, 2, 5, 50, 50, 1000, v - 1, v, v + 3, 0], g)
    if "top_p" in parts:
        top_p = _draw(s, [1e-7, 0.05, 0.5, 0.9, 0.9, 0.95, 0.999, 0.99999, 1.0], g)
    if "min_p" in parts:
        min_p = _draw(s, [0.0, 1e-4, 0.01, 0.1, 0.5, 1.0], g)
    if filters == "greedy":
        temp = [0.0] * s
    if filters == "mixed":
        temp = [0.0 if i % 3 == 0 else t for i, t in enumerate(temp)]
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    meta = SamplingMetadata(
        temperature=f32(temp),
        top_k=torch.tensor(top_k, dtype=torch.int32),
        top_p=f32(top_p),
        min_p=f32(min_p),
        seeds=torch.randint(-(2**63), 2**63 - 1, (s,), generator=g),
        offsets=torch.randint(0, 2**40, (s,), generator=g),
        repetition_penalty=torch.ones(s),
        presence_penalty=torch.zeros(s),
        frequency_penalty=torch.zeros(s),
        all_greedy=filters == "greedy",
    )
    if filters in ("mixed", "penalties"):
        meta.repetition_penalty = 1 + torch.rand(s, generator=g)
        meta.presence_penalty = torch.rand(s, generator=g)
        meta.frequency_penalty = torch.rand(s, generator=g)
        counts = torch.randint(0, 3, (s, v), dtype=torch.int32, generator=g)
        counts[torch.rand(s, v, generator=g) < 0.95] = 0
        meta.output_counts = counts
        meta.prompt_mask = torch.rand(s, v, generator=g) < 0.02
    for name in meta.__dataclass_fields__:
        val = getattr(meta, name)
        if isinstance(val, torch.Tensor):
            setattr(meta, name, val.to(device))
    return logits.to(device), meta
