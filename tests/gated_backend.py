"""A rank daemon backend for live tests that must hold a request in the worker (a drain that
finds it queued or running, an adoption that hands it back): the sim backend with a gate."""

from __future__ import annotations

import asyncio
from typing import Any

from services.rankd.backend import SimBackend
from shared.schemas import Assignment


class GatedBackend(SimBackend):
    """The sim backend, holding every prefill until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__(prefill_time=lambda r, p, c, kind="cp": 0.01)
        self.gate = asyncio.Event()

    async def prefill(self, assignment: Assignment) -> Any:
        await self.gate.wait()
        return await super().prefill(assignment)
