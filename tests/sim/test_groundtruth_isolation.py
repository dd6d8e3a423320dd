"""Honesty of evaluation: policy code never sees the simulator's ground truth.

The scheduler, controller, cache manager and gateway only ever get a fitted Profile. The rank
daemon is the one place allowed to use it: its ``sim`` backend *is* the simulated hardware.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("services", "shared")
ALLOWED = ("services/rankd/",)  # the sim execution backend stands in for the GPUs


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_policy_module_imports_the_ground_truth() -> None:
    offenders = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            if any("groundtruth" in name for name in _imports(path)):
                offenders.append(rel)
    assert not offenders, f"policy code imports the ground truth: {offenders}"
