"""Scheduler tests: make the helper module ``sched_support`` importable.

pytest runs with ``--import-mode=importlib`` (no package __init__ files), so sibling modules are
not importable by default; the helper has a unique name to avoid clashing with other suites.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
