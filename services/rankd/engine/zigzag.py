"""The zigzag partition of R new tokens over C ranks (paper §2.1, Figure 1; cp-attention.md
rules 1, 2, 9). Pure index arithmetic, no torch.distributed.

R_pad = ceil(R / 2C)·2C, L = R_pad / 2C. Rank k owns chunks k and 2C−1−k, i.e. new-token
offsets [kL, (k+1)L) ++ [(2C−1−k)L, (2C−k)L) in that order; offsets ≥ R are padding (at the
end, so padded keys sit at positions ≥ P + R and are invisible to every real query).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shared.ids import InvalidInput


@dataclass(frozen=True, slots=True)
class ZigzagPlan:
    """Partition of ``r`` new tokens (r >= 1) over ``degree`` ranks."""

    r: int
    degree: int

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidInput(f"R must be >= 1, got {self.r}")
        if self.degree < 1:
            raise InvalidInput(f"degree must be >= 1, got {self.degree}")

    @property
    def r_pad(self) -> int:
        two_c = 2 * self.degree
        return -(-self.r // two_c) * two_c

    @property
    def chunk(self) -> int:
        """L, the length of one chunk."""
        return self.r_pad // (2 * self.degree)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank ``rank`` owns, early chunk first."""
        if not 0 <= rank < self.degree:
            raise InvalidInput(f"rank {rank} outside [0, {self.degree})")
        return rank, 2 * self.degree - 1 - rank

    def offsets(self, rank: int) -> Tensor:
        """New-token offsets (2L,) int64 of ``rank``'s rows, in its local row order."""
        ell = self.chunk
        a, b = self.chunks(rank)
        return torch.cat(
            [torch.arange(a * ell, (a + 1) * ell), torch.arange(b * ell, (b + 1) * ell)]
        )

    def gather_offsets(self) -> Tensor:
        """Offsets (R_pad,) of the rows of an all-gather of every rank's local rows (rank order)."""
        return torch.cat([self.offsets(k) for k in range(self.degree)])

    def restore_index(self) -> Tensor:
        """Index (R_pad,) such that ``gathered[restore_index()]`` is in natural order (rule 9)."""
        return torch.argsort(self.gather_offsets())

    def real_rows(self, rank: int) -> Tensor:
        """Boolean (2L,) of ``rank``'s rows that are real tokens (offset < R)."""
        return self.offsets(rank) < self.r
