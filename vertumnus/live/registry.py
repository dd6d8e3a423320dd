"""The live services as data: how to run each one and which ``VTM_*`` settings it reads.

One table (:data:`SERVICES`) serves ``vertumnus up`` (which module to start), the per-service
CLI commands (which module to delegate to) and the docker-compose test (every command names a
runnable module, every environment variable is a real setting). Settings classes are found by
import, not hard-coded, so a service that gains a setting needs no change here; a service whose
modules have not landed yet is reported as missing instead of breaking everything else.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from pydantic_settings import BaseSettings

from shared.settings import ServiceSettings, env_names

ENV_PREFIX: Final[str] = "VTM_"
NESTED: Final[str] = "__"


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """One live service: ``module`` is what ``python -m`` runs; its micro service ``micro``."""

    name: str
    module: str
    micro: str
    settings_modules: tuple[str, ...]
    doc: str

    def runnable(self) -> bool:
        """True if ``python -m {module}`` would find something to run."""
        return module_runnable(self.module)

    def settings_class(self) -> type[ServiceSettings] | None:
        """The service's settings class (a ServiceSettings subclass), or None if not importable."""
        for mod_name in self.settings_modules:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            found = [
                obj
                for _, obj in inspect.getmembers(mod, inspect.isclass)
                if issubclass(obj, ServiceSettings)
                and obj is not ServiceSettings
                and obj.__module__ == mod.__name__
            ]
            if found:
                # The most derived class defined there (e.g. the launcher's subclass).
                found.sort(key=lambda c: len(c.__mro__), reverse=True)
                return found[0]
        return None


SERVICES: Final[Mapping[str, ServiceInfo]] = {
    s.name: s
    for s in (
        ServiceInfo("gateway", "services.gateway", "vtm-gateway",
                    ("services.gateway.settings",), "HTTP / NATS completions onto the intake"),
        ServiceInfo("scheduler", "services.scheduler", "vtm-scheduler",
                    ("services.scheduler.settings", "services.scheduler.service"),
                    "places intake requests on workers (policy registry)"),
        ServiceInfo("controller", "services.controller", "vtm-controller",
                    ("services.controller.settings", "services.controller.service",
                     "services.controller.main"),
                    "demand windows, split / merge, epoch records"),
        ServiceInfo("cachemgr", "services.cachemgr", "vtm-cachemgr",
                    ("services.cachemgr.settings", "services.cachemgr.service",
                     "services.cachemgr.main"),
                    "global prefix trie, replication / reclamation"),
        ServiceInfo("rankd", "services.rankd.main", "vtm-rankd",
                    ("services.rankd.settings",), "rank daemons (one worker, or a host of them)"),
    )
}
"""The five live services, in the order ``vertumnus up`` starts them."""

SIM_RANKD: Final[ServiceInfo] = ServiceInfo(
    "rankd", "vertumnus.live.rankd_sim", "vtm-rankd", ("vertumnus.live.rankd_sim",),
    "rank daemons on the sim backend timed by the simulator's ground truth",
)
"""rankd with the ``sim`` backend timed by ``sim.groundtruth`` (what ``vertumnus up`` runs)."""


def module_runnable(module: str) -> bool:
    """``python -m module`` works: a module file, or a package with ``__main__``."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package
        try:
            return importlib.util.find_spec(f"{module}.__main__") is not None
        except (ImportError, ValueError):
            return False
    return True


def filter_env(settings_cls: type[BaseSettings] | None, env: Mapping[str, str],
               ) -> tuple[dict[str, str], list[str]]:
    """Split ``env`` into (variables the service reads, names it would ignore).

    With no settings class (service not importable) nothing is filtered.
    """
    if settings_cls is None:
        return dict(env), []
    known = env_names(settings_cls)
    kept = {k: v for k, v in env.items() if k.upper() in known}
    return kept, sorted(k for k in env if k.upper() not in known)


__all__ = [
    "SERVICES",
    "SIM_RANKD",
    "ServiceInfo",
    "env_names",
    "filter_env",
    "module_runnable",
]
