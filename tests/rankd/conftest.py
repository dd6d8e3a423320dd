"""Rank daemon tests: the helpers that drive one worker service as the scheduler does
(``rankd_support``, kept with the live tests in tests/live) made importable here too.

pytest runs with ``--import-mode=importlib`` (no package __init__ files), so a sibling
folder's modules are not importable by default; ``rankd_support`` is a unique module name.
"""

from __future__ import annotations

import sys
from pathlib import Path

_LIVE = str(Path(__file__).resolve().parents[1] / "live")
if _LIVE not in sys.path:
    sys.path.insert(0, _LIVE)
