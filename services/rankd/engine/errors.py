"""Typed errors of the engine. All derive from :class:`shared.ids.InvalidInput` (bad input) so
adapters map them to one error class; the specific subclasses let callers and tests tell them
apart.

NOTE: every check that raises one of these runs before any collective and before any state
change, on every rank with the same inputs, so a bad request leaves every rank usable.
"""

from __future__ import annotations

from shared.ids import InvalidInput


class CheckpointError(InvalidInput):
    """A model directory is malformed: missing/unparsable config, missing or misshaped tensors."""


class TokenOutOfVocab(InvalidInput):
    """A token id is negative or >= vocab_size."""


class SequenceTooLong(InvalidInput):
    """P + R exceeds max_position_embeddings."""


class GroupError(InvalidInput):
    """An unknown degree/lattice group, or a switch requested at an illegal point."""


class KVFormatError(InvalidInput):
    """A serialized KV payload (chunks, pages) is malformed or incomplete."""
