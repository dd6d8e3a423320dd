"""Policies by name: ``register_policy`` to add one, ``make_policy`` to build one.

Selection is a registry lookup, never an if/elif ladder (the llm-d scheduler's plugin model): a
new baseline is one module with one decorated class in :mod:`services.scheduler.policies`.

A registered factory is called as ``factory(profile=..., rng=..., **params)``; every policy
accepts ``profile`` (the *fitted* cost model — never ground truth) and ``rng`` (a seeded
:class:`random.Random`; policies that draw no random numbers ignore it) and exposes its own
parameters with its source's defaults as keyword arguments.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable
from typing import Any, TypeVar

from services.scheduler.errors import UnknownPolicy
from services.scheduler.policy import Policy
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import InvalidInput, VertumnusError

PolicyFactory = Callable[..., Policy]
F = TypeVar("F", bound=PolicyFactory)

_REGISTRY: dict[str, PolicyFactory] = {}
_BUILTINS_LOADED = False


def register_policy(name: str) -> Callable[[F], F]:
    """Class/factory decorator: make it buildable as ``make_policy(name, ...)``."""
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum():
        raise InvalidInput(f"policy name must be a non-empty identifier, got {name!r}")

    def deco(factory: F) -> F:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise InvalidInput(f"policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def unregister_policy(name: str) -> None:
    """Remove a registered policy (tests and plugin reloads); unknown name → UnknownPolicy."""
    if name not in _REGISTRY:
        raise UnknownPolicy(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}"
        )
    del _REGISTRY[name]


def _load_builtins() -> None:
    # The built-in policies register themselves on import; import lazily so that the policy
    # modules may import this one without a cycle.
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        importlib.import_module("services.scheduler.policies")
        _BUILTINS_LOADED = True


def policy_names() -> tuple[str, ...]:
    """Every registered policy name, sorted."""
    _load_builtins()
    return tuple(sorted(_REGISTRY))


def policy_durations(name: str) -> dict[str, float]:
    """The duration parameters of policy ``name`` (keyword parameters named ``*_s``, in
    seconds of the time the policy is given: a refresh period, an eviction interval) with
    their defaults. A harness that runs time scaled (``vertumnus up``: wall = modelled ×
    scale) scales these as it scales every other period, so the policy behaves in modelled
    time as in the simulator. :class:`UnknownPolicy` for an unknown name."""
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UnknownPolicy(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}"
        )
    return {
        k: float(p.default)
        for k, p in inspect.signature(factory).parameters.items()
        if k.endswith("_s") and isinstance(p.default, int | float)
        and not isinstance(p.default, bool)
    }


def make_policy(
    name: str,
    *,
    profile: Profile = DEFAULT_PROFILE,
    rng: random.Random | None = None,
    **params: Any,
) -> Policy:
    """Build the policy registered as ``name``.

    ``rng`` defaults to ``random.Random(0)`` so that an unseeded run is still reproducible.
    Unknown name → :class:`UnknownPolicy` listing the known ones; an unknown or invalid parameter
    → :class:`InvalidInput` naming the policy's accepted parameters.
    """
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UnknownPolicy(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(_REGISTRY))}"
        )
    if not isinstance(profile, Profile):
        raise InvalidInput(
            f"profile must be a shared.costmodel.Profile, got {type(profile).__name__}"
        )
    if rng is None:
        rng = random.Random(0)
    elif not isinstance(rng, random.Random):
        raise InvalidInput(f"rng must be a random.Random, got {type(rng).__name__}")
    sig = inspect.signature(factory)
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in params if k not in sig.parameters or k in ("profile", "rng")]
    if unknown and not accepts_kwargs:
        known = [k for k in sig.parameters if k not in ("self", "profile", "rng")]
        raise InvalidInput(
            f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}; "
            f"its parameters: {', '.join(known) or '(none)'}"
        )
    try:
        return factory(profile=profile, rng=rng, **params)
    except VertumnusError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"policy {name!r}: bad parameters {params!r}: {exc}") from exc
