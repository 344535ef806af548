"""The device tensors of the paged KV cache (the block bookkeeping is KVCacheManager's).

One allocation ``[num_layers, 2, num_blocks, tokens_per_block, nkv, hd]``; layer i's K and
V are the contiguous views ``[num_blocks, tokens_per_block, nkv, hd]`` the Backend ops
take (layout: ``llmc.cuda.backend``). Block ids handed out by the KVCacheManager index
dimension 2 directly. The cache is zero-initialised so an unwritten slot is never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.base.errors import CapacityError, ConfigError
from llmc.compiler.spec import ModelSpec


@dataclass(frozen=True)
class KVCacheTensors:
    """Per-layer K/V cache views over one storage tensor."""

    storage: torch.Tensor  # [L, 2, num_blocks, tokens_per_block, nkv, hd]
    tokens_per_block: int

    @property
    def num_layers(self) -> int:
        return self.storage.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[2]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self.storage[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.storage[layer, 1]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage[layer, 0], self.storage[layer, 1]

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(layer)


def allocate_kv_cache(
    spec: ModelSpec,
    num_blocks: int,
    tokens_per_block: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCacheTensors:
    """Allocate the zeroed cache of ``num_blocks`` blocks for every layer of ``spec``."""
    for name, value in (("num_kv_blocks", num_blocks), ("tokens_per_block", tokens_per_block)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    shape = (spec.num_layers, 2, num_blocks, tokens_per_block, spec.num_kv_heads, spec.head_dim)
    try:
        storage = torch.zeros(shape, dtype=dtype, device=device)
    except torch.OutOfMemoryError as e:  # pragma: no cover - depends on the device
        nbytes = spec.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
        raise CapacityError(
            f"KV cache of {num_blocks} blocks x {tokens_per_block} tokens "
            f"({num_blocks * tokens_per_block * nbytes / 2**30:.2f} GiB) does not fit on "
            f"{device}; lower num_kv_blocks / max_kv_tokens"
        ) from e
    return KVCacheTensors(storage=storage, tokens_per_block=tokens_per_block)
