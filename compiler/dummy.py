"""Dummy weights (``--load_format dummy``): random engine tensors made from a seed.

An engine built with dummy weights stores only the seed; the runtime calls
``dummy_weights`` on the device it runs on, so a 16 GB model appears in well under a second
on an H200 instead of being read from disk.

Invariants:
- names and shapes are exactly ``spec.tensor_shapes()`` (execution layout);
- each tensor comes from its own ``torch.Generator`` on ``device``, seeded from
  ``(seed, tensor name)``: the same seed gives the same values on the same device, whatever
  other tensors exist, and generation happens on the device (no host copy);
- values keep activations sane over many layers: norms are 1, matrices N(0, 0.02²), and
  the two projections that write into the residual stream (o_proj, down_proj) are scaled by
  1/sqrt(2 * num_layers) (GPT-2's scheme), so the residual grows slowly with depth.

An fp8 engine's dummy weights are these, quantized at load (``LoadedEngine.load_weights``
through ``weight_passes.quantize_engine_weights``, one tensor at a time, on the device).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch

from llmc.base.errors import ConfigError
from llmc.compiler.spec import ModelSpec
from llmc.compiler.weight_passes import TORCH_DTYPES

STD = 0.02
_NORMS = ("input_norm", "post_attn_norm", "final_norm")
_RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one tensor, stable across runs and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tensor_std(spec: ModelSpec, name: str) -> float:
    if name.endswith(_RESIDUAL_OUTPUTS):
        return STD / math.sqrt(2 * spec.num_layers)
    return STD


def dummy_weights(
    spec: ModelSpec, dtype: str, seed: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Engine tensors (``spec.tensor_shapes()``) of random values, deterministic per seed."""
    return dict(iter_dummy_weights(spec, dtype, seed, device))


def iter_dummy_weights(
    spec: ModelSpec, dtype: str, seed: int, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """``dummy_weights`` one tensor at a time (an fp8 engine quantizes each as it comes, so
    the activation-dtype copies of an 8B model never exist all at once)."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dummy weights: dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"dummy weights: seed must be an integer, got {seed!r}")
    dt, dev = TORCH_DTYPES[dtype], torch.device(device)
    for name, shape in spec.tensor_shapes().items():
        if name.endswith(_NORMS):
            yield name, torch.ones(shape, dtype=dt, device=dev)
            continue
        gen = torch.Generator(device=dev)
        gen.manual_seed(tensor_seed(seed, name))
        t = torch.empty(shape, dtype=dt, device=dev)
        t.normal_(0.0, tensor_std(spec, name), generator=gen)
        yield name, t
