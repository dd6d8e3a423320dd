"""Chained block identities for workloads that carry no hash ids of their own.

A block's identity is a hash chained over its parent's identity and a key naming the
block's *content* (design.md: equal hash ⇔ equal prefix). Two requests get the same id for
block j exactly when they share block j's content and every block before it, because the
parent id is part of the hash. Ids are 63-bit non-negative ints (fit in a signed int64).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable
from typing import Final

ROOT_PARENT: Final[int] = 0
_MASK: Final[int] = (1 << 63) - 1


def chain_hash(parent: int, key: Hashable) -> int:
    """Identity of a block whose content is named by ``key`` and whose prefix ends in ``parent``."""
    h = hashlib.blake2b(f"{parent}|{key!r}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & _MASK


def chain(keys: Iterable[Hashable], parent: int = ROOT_PARENT) -> tuple[int, ...]:
    """Identities of consecutive blocks with content ``keys``, continuing after ``parent``."""
    out: list[int] = []
    for key in keys:
        parent = chain_hash(parent, key)
        out.append(parent)
    return tuple(out)
