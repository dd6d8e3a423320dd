"""``VTM_*`` environment variables that no vertumnus process reads: a misspelt name.

pydantic-settings looks up only the variables of a settings class's fields, so a misspelt
top-level one (``VTM_WINDOWS_S``) would be ignored and the process would start on the default.
One environment may serve several processes, though (docker-compose's shared anchor of
``VTM_*`` variables, one ``.env`` for all), so a variable is a mistake only when *no* vertumnus
process reads it: :func:`unknown_variables` finds those, with the known name it is closest to.

Who reads what: every process's settings class (:data:`SETTINGS_CLASSES`, as
``"module:Class"``, imported only when the process's own class does not explain a variable:
the usual start imports nothing more) and the names the code reads one by one
(:data:`NAME_CONSTANTS`, :data:`OTHER_NAMES`). Every name is exact (only a dict setting's
``VTM_FIELD__*`` keys are open): the torch backend's settings too, which live in a module
without torch (services/rankd/torch_settings.py) for this check's sake.
tests/shared/test_envcheck.py checks these lists against the code (every settings class and
every ``"VTM_..."`` literal of services/, shared/, vertumnus/ and sim/), so that they cannot
fall behind it.

Pure apart from the lazy imports; ``shared`` imports neither ``services`` nor ``vertumnus``
at module import time.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel
from pydantic_settings import BaseSettings

from shared.settings import NESTED, env_names

ENV_PREFIX: Final[str] = "VTM_"

SETTINGS_CLASSES: Final[tuple[str, ...]] = (
    "services.gateway.settings:GatewaySettings",
    "services.scheduler.service:SchedulerSettings",
    "services.controller.service:ControllerSettings",
    "services.cachemgr.service:CacheMgrSettings",
    # One rank daemon or a host of them (services/rankd/host.py reads the same class).
    "services.rankd.settings:RankdSettings",
    # The sim launcher of `vertumnus up`, `vertumnus rankd` and docker-compose (VTM_TRUTH...).
    "vertumnus.live.rankd_sim:SimRankdSettings",
    # rankd's torch backend (VTM_TORCH_*) and `vertumnus profile --backend torch`: torch-free
    # module, re-exported by services/rankd/torch_backend.py.
    "services.rankd.torch_settings:TorchSettings",
)
"""The settings class of every vertumnus process, as ``"module:Class"``."""

NAME_CONSTANTS: Final[tuple[str, ...]] = (
    "shared.natsserver:BINARY_ENV",  # VTM_NATS_SERVER_BIN: the nats-server `up` starts
    "vertumnus.live.http:GATEWAY_CA_ENV",  # VTM_GATEWAY_CA: the CLI's HTTPS client
)
"""Variables the code reads by name outside a settings class, as ``"module:CONSTANT"``."""

OTHER_NAMES: Final[frozenset[str]] = frozenset({
    "VTM_API_KEY",  # `vertumnus replay --api-key` (typer's envvar=, vertumnus/cmd_live.py)
    # The rank processes' opt-in varlen kernel (services/rankd/engine/attention.py): a literal
    # there, in a module that imports torch (no constant here could import it without torch).
    "VTM_TORCH_VARLEN",
})
"""Variables read by name where no constant holds the name."""


@dataclass(frozen=True, slots=True)
class Readers:
    """What some processes read: exact names (upper case) and name prefixes."""

    names: frozenset[str]
    prefixes: tuple[str, ...] = ()

    def reads(self, var: str) -> bool:
        """``var`` is read. Case-insensitive, as pydantic-settings matches (no settings class
        here sets ``case_sensitive``; one that did would read fewer names, never more, so
        this errs on the side of silence)."""
        up = var.upper()
        return up in self.names or up.startswith(self.prefixes)


def _is_mapping(annotation: Any) -> bool:
    """The annotation is a dict (or a dict or None): pydantic-settings fills such a field from
    ``VTM_FIELD__KEY`` variables as well (a key each)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_mapping(a) for a in typing.get_args(annotation))
    target = origin if origin is not None else annotation
    return inspect.isclass(target) and issubclass(target, Mapping)


def _mapping_prefixes(model: type[BaseModel], prefix: str) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann: Any = field.annotation
        if _is_mapping(ann):
            out.append(f"{prefix}{name}{NESTED}".upper())
        elif inspect.isclass(ann) and issubclass(ann, BaseModel) and not issubclass(
                ann, BaseSettings):
            out.extend(_mapping_prefixes(ann, f"{prefix}{name}{NESTED}"))
    return out


def readers_of(settings_cls: type[BaseSettings]) -> Readers:
    """What ``settings_cls`` reads: :func:`~shared.settings.env_names` and, for a dict field,
    every ``VTM_FIELD__*``. (A misspelt field of a nested group, ``VTM_TELEMETRY__EXPORTR``,
    is pydantic's to reject: the groups forbid extra fields.)"""
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    return Readers(env_names(settings_cls), tuple(_mapping_prefixes(settings_cls, prefix)))


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def all_readers() -> Readers | None:
    """What every vertumnus process reads, or None when one of the lists' modules cannot be
    imported. Then nothing can be called unknown: that module's process may read the
    variable, and a process must not die for a variable another one reads (an installation
    without some module, a dependency missing). None of the modules needs torch (the torch
    backend's settings have a module of their own), so the control-plane image, which has no
    torch, imports them all; tests/shared/test_envcheck.py checks that, with torch
    unimportable."""
    names: set[str] = set(OTHER_NAMES)
    prefixes: list[str] = []
    try:
        for ref in SETTINGS_CLASSES:
            r = readers_of(_load(ref))
            names |= r.names
            prefixes.extend(r.prefixes)
        for ref in NAME_CONSTANTS:
            names.add(str(_load(ref)).upper())
    except Exception:  # noqa: BLE001 -- ImportError, or whatever else an import raises
        return None
    return Readers(frozenset(names), tuple(sorted(set(prefixes))))


def suggestion(var: str, names: frozenset[str]) -> str | None:
    """The known name closest to ``var`` (difflib, on the part after ``VTM_``), or None."""
    rest = {n[len(ENV_PREFIX):]: n for n in names if n.startswith(ENV_PREFIX)}
    close = difflib.get_close_matches(var.upper()[len(ENV_PREFIX):], sorted(rest), n=1)
    return rest[close[0]] if close else None


def unknown_variables(environ: Mapping[str, str], own: type[BaseSettings]) -> list[str]:
    """One problem line per variable of ``environ`` whose name starts with ``VTM_`` (in any
    case, as pydantic-settings matches names) that neither ``own`` nor any other vertumnus
    process reads, sorted by name: ``VTM_WINDOWS_S: no vertumnus service reads it (did you
    mean VTM_WINDOW_S?)``. Empty when there is none -- or when the other processes' settings
    cannot all be imported (:func:`all_readers`)."""
    mine = readers_of(own)
    left = sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and not mine.reads(k))
    if not left:
        return []
    every = all_readers()
    if every is None:
        return []
    known = every.names | mine.names
    lines = []
    for var in left:
        if every.reads(var):
            continue
        close = suggestion(var, known)
        lines.append(f"{var}: no vertumnus service reads it"
                     + (f" (did you mean {close}?)" if close else ""))
    return lines


__all__ = [
    "NAME_CONSTANTS",
    "OTHER_NAMES",
    "SETTINGS_CLASSES",
    "Readers",
    "all_readers",
    "readers_of",
    "suggestion",
    "unknown_variables",
]
