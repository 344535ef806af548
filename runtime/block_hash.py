"""Content hashes of full KV-cache blocks, chained through the prefix (no torch).

The hash of block ``i`` of a sequence covers the hash of block ``i - 1`` and the token ids of
block ``i``, so equal hashes mean equal whole prefixes, not just equal blocks. A 128-bit
BLAKE2b digest is used rather than Python's ``hash()``: a collision would silently serve
another prompt's K/V, and a cryptographic digest makes that practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(16)
"""Parent hash of a sequence's first block."""


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one block: digest(parent hash ‖ token ids as little-endian int64)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    out: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = block_hash(parent, token_ids[start : start + tokens_per_block])
        out.append(parent)
    return out
