"""Chained block hashes: the identity of a cache block is a hash over every preceding token.

NOTE: this function is shared by the gateway and rankd; changing the byte layout changes
every block identity in the system (and invalidates every cache index).

Layout of one block's digest input: the parent's hash as 8 little-endian bytes (zero bytes
for the first block) followed by the block's tokens as a little-endian int32 array.
blake2b with an 8-byte digest is deterministic across processes and platforms (unlike
Python's ``hash``); the top bit is cleared so every hash fits a signed 64-bit integer
(JSON, msgpack int64, SQL BIGINT).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np

from shared.ids import BlockHash, InvalidInput

HASH_MASK: Final[int] = (1 << 63) - 1
_INT32_MIN: Final[int] = -(1 << 31)
_INT32_MAX: Final[int] = (1 << 31) - 1


def block_hash(parent: int | None, tokens: Sequence[int] | np.ndarray) -> BlockHash:
    """Hash of one block chained over ``parent`` (None for the first block of a sequence)."""
    if parent is not None and not (0 <= int(parent) <= HASH_MASK):
        raise InvalidInput(f"parent hash must be an unsigned 63-bit int, got {parent!r}")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise InvalidInput("token ids must fit in int32")
    h = hashlib.blake2b(digest_size=8)
    h.update(int(parent or 0).to_bytes(8, "little"))
    h.update(arr.astype("<i4").tobytes())
    return BlockHash(int.from_bytes(h.digest(), "little") & HASH_MASK)


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int | None = None
) -> list[BlockHash]:
    """Hashes of every FULL block of ``token_ids`` (a trailing partial block has none).

    ``parent`` is the hash of the block preceding ``token_ids[0]`` (None at sequence start),
    so hashing a suffix with the prefix's last hash as parent equals hashing the whole.
    Returns ``len(token_ids) // block_size`` unsigned 63-bit ints.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise InvalidInput(f"block_size must be an integer >= 1, got {block_size!r}")
    arr = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    out: list[BlockHash] = []
    prev = parent
    for b in range(arr.size // block_size):
        prev = block_hash(prev, arr[b * block_size : (b + 1) * block_size])
        out.append(prev)
    return out
