"""The policy cores must stay pure: no nats, asyncio or torch, directly or transitively.

Each core module is imported in a fresh interpreter and the test checks which modules got
loaded, so an indirect import (a core importing a helper that imports nats) is caught too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("nats", "asyncio", "torch")

# Every module that holds policy logic. New cores are added here as they land.
CORE_MODULES = [
    "shared.ids",
    "shared.worker",
    "shared.costmodel",
]
CORE_PACKAGES = [
    "services/scheduler",
    "services/cachemgr",
    "services/controller",
]
# Adapter modules (NATS glue) are allowed to import nats/asyncio; so are the adapters'
# OpenTelemetry instruments (metrics.py: shared.metrics reads the service settings, and
# pydantic-settings imports asyncio; tracing.py: the spans an adapter records), which record
# what an adapter did and decide nothing.
ADAPTER_NAMES = {"adapter.py", "main.py", "service.py", "__main__.py", "app.py", "metrics.py",
                 "tracing.py"}


def _discover() -> list[str]:
    mods = list(CORE_MODULES)
    for pkg in CORE_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name in ADAPTER_NAMES or path.name == "__init__.py":
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            mods.append(".".join(rel.parts))
    mods += ["services.rankd.blockcache", "services.rankd.core"]
    return mods


@pytest.mark.parametrize("module", _discover())
def test_core_module_imports_no_io_or_torch(module: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert not bad, f"{module} pulls in {bad[:5]}"
