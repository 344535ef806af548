"""One rank's engine tensors cut from the whole model's (``compiler/tp_layout.py`` says which
rows or columns): the build writes them as the rank's weight file; a dummy engine's rank
cuts each regenerated tensor as it comes, so the whole model never exists at once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from llmc.compiler.spec import ModelSpec
from llmc.compiler.tp_layout import Split, tensor_splits


def cut(tensor: torch.Tensor, split: Split | None) -> torch.Tensor:
    """The rank's part of ``tensor``: its ranges along the split axis, concatenated (a new
    contiguous tensor), or the tensor itself when the rank holds it whole."""
    if split is None:
        return tensor
    parts = [tensor.narrow(split.axis, a, b - a) for a, b in split.ranges]
    return torch.cat(parts, dim=split.axis).contiguous()


def iter_rank_tensors(
    spec: ModelSpec, tensors: Iterable[tuple[str, torch.Tensor]], tp_size: int, rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the whole model → the same names, cut for ``rank``."""
    splits = tensor_splits(spec, tp_size, rank)
    for name, t in tensors:
        yield name, cut(t, splits[name])


def rank_tensors(
    spec: ModelSpec, tensors: Mapping[str, torch.Tensor], tp_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """The whole model's engine tensors → rank ``rank``'s (same names, its shapes)."""
    return dict(iter_rank_tensors(spec, tensors.items(), tp_size, rank))
