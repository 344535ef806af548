"""Content hashes of full KV-cache blocks, chained through the prefix (no torch).

The hash of block ``i`` of a sequence covers the hash of block ``i - 1`` and the token ids of
block ``i``, so equal hashes mean equal whole prefixes, not just equal blocks. A 128-bit
BLAKE2b digest is used rather than Python's ``hash()``: a collision would silently serve
another prompt's K/V, and a cryptographic digest makes that practically impossible.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Any

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(16)
"""Parent hash of a sequence's first block."""


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one block: digest(parent hash ‖ token ids as little-endian int64).

    One digest call over the packed bytes (a ``struct`` packer per block length, made once:
    every decode row hashes a block each ``tokens_per_block`` steps)."""
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        if len(_PACKERS) >= 64:  # (block lengths are few: the engine's tokens_per_block)
            return _blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()
        pack = _PACKERS[n] = struct.Struct(f"<{n}q").pack
    return _blake2b(parent + pack(*token_ids), digest_size=16).digest()


_blake2b = hashlib.blake2b
_PACKERS: dict[int, Any] = {}
"""``struct`` packers of ``n`` little-endian int64 by ``n`` (a cache, not state: equal
bytes whatever is in it)."""


def chain_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    out: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = block_hash(parent, token_ids[start : start + tokens_per_block])
        out.append(parent)
    return out
