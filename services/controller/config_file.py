"""The controller's thresholds as a file: try another setting in the simulator before deploying it.

``vertumnus simulate --controller my-controller.toml`` (also ``tune``, ``size`` and the trace
and reconfiguration presets) runs every adaptive pool with the thresholds the file gives; a
field left out keeps the calibrated value (``services/calibration.py`` ``CONTROLLER``).
``vertumnus controller-config`` prints the calibrated setting as such a file, with a comment on
each field. The keys are the fields of :class:`~services.controller.planner.ControllerConfig`,
the same names the live controller reads as ``VTM_<NAME>`` variables
(:class:`~services.controller.service.ControllerSettings`). ``false`` gives an optional field
its None (a rule off, or what :data:`NONE_MEANS` says; TOML has no null, JSON takes ``null``
as well). Example::

    upper = 0.8          # split once D > 0.8·K
    split_target = 0.8   # a split plan stops at D <= 0.8·K (must not exceed upper)
    large_floor = false  # rule 13 off

Every value is checked (a number where a number belongs, an integer where one is counted, a
boolean for a switch), and the whole setting must satisfy ``ControllerConfig``'s own bounds
(e.g. 0 < lower < upper, split_target <= upper); errors are :class:`~shared.ids.InvalidInput`
naming the file and the key. Pure apart from :func:`load_controller_config`, which reads it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Final, Literal

from services.calibration import CONTROLLER
from services.controller.planner import ControllerConfig
from shared.files import config_number, read_config_file, toml_value
from shared.ids import InvalidInput

_Kind = Literal["float", "int", "bool"]


def _kinds() -> dict[str, tuple[_Kind, bool]]:
    """Field name -> (its value's kind, whether None (off) is allowed), from the dataclass's
    annotations (strings under ``from __future__ import annotations``: "float | None")."""
    out: dict[str, tuple[_Kind, bool]] = {}
    for f in fields(ControllerConfig):
        parts = [p.strip() for p in str(f.type).split("|")]
        base = parts[0]
        if base not in ("float", "int", "bool"):  # a new field of another type: say so in tests
            raise TypeError(f"ControllerConfig.{f.name}: unsupported type {f.type!r}")
        out[f.name] = (base, "None" in parts)  # type: ignore[assignment]
    return out


FIELD_KINDS: Final[Mapping[str, tuple[_Kind, bool]]] = _kinds()
"""Each field of :class:`ControllerConfig`: (``"float"`` / ``"int"`` / ``"bool"``, optional)."""

NONE_MEANS: Final[Mapping[str, str]] = {
    "merge_speedup": "rule 9 off",
    "preference_shift": "rule 10 off",
    "preference_headroom": "upper",
    "merge_memory": "the streak's windows only",
    "long_shift": "rule 12 off",
    "long_shift_persistence": "persistence",
    "long_drop": "rule 15 off",
    "long_drop_z": "no significance asked",
    "long_drop_demand": "any demand",
    "large_floor": "rule 13 off",
    "backlog_s": "rule 14 off",
}
"""What None (``false`` in a file) means for each optional field (the template's comments)."""


def _value(at: str, v: Any, kind: _Kind, optional: bool) -> float | int | bool | None:
    if optional and (v is None or v is False):
        return None
    if kind == "bool":
        if not isinstance(v, bool):
            raise InvalidInput(f"{at}: must be true or false, got {v!r}")
        return v
    return config_number(at, v, integer=kind == "int", also=" (or false)" if optional else "")


def config_from_mapping(data: Any, *, source: str = "controller file",
                        base: ControllerConfig = CONTROLLER) -> ControllerConfig:
    """The controller setting a parsed file describes: ``base`` (default: the calibrated one)
    with the file's fields replaced. Raises :class:`InvalidInput` naming ``source`` and the
    key: not a table, an unknown key, a value of the wrong kind, or a setting outside
    ``ControllerConfig``'s bounds."""
    if not isinstance(data, Mapping):
        raise InvalidInput(f"{source}: must be a table of controller fields, got "
                           f"{type(data).__name__}")
    values: dict[str, Any] = {}
    for key, v in data.items():
        if key not in FIELD_KINDS:
            raise InvalidInput(f"{source}: unknown key {key!r}; the keys are "
                               f"{', '.join(FIELD_KINDS)}")
        kind, optional = FIELD_KINDS[key]
        values[key] = _value(f"{source}: {key}", v, kind, optional)
    try:
        return replace(base, **values)
    except InvalidInput as exc:  # a bound across fields, e.g. split_target <= upper
        msg = str(exc)
        # A bound broken by a field the file left out (upper lowered below the calibrated
        # split_target): say that it kept its value, so the fix is plain.
        m = re.match(r"ControllerConfig\.(\w+)", msg)
        if m and m.group(1) in FIELD_KINDS and m.group(1) not in values:
            msg += (f" ({m.group(1)} is not in the file and keeps "
                    f"{_toml_value(getattr(base, m.group(1)))}; set it there too)")
        raise InvalidInput(f"{source}: {msg}") from None


def config_to_mapping(config: ControllerConfig) -> dict[str, Any]:
    """Every field of ``config`` as JSON-ready values (None: the rule is off); a file of this
    mapping reads back as ``config``."""
    return {f.name: getattr(config, f.name) for f in fields(ControllerConfig)}


def _toml_value(v: Any) -> str:
    """A field's value in a file: None (an optional rule off) is ``false``."""
    return "false" if v is None else toml_value(v)


def config_to_toml(config: ControllerConfig, help: Mapping[str, str] | None = None) -> str:
    """``config`` as a commented TOML controller file: one ``key = value`` line per field, each
    after a comment with ``help[key]`` (when given) and, for an optional field, what ``false``
    means (:data:`NONE_MEANS`)."""
    lines = [
        "# Controller thresholds (vertumnus simulate --controller FILE); services/calibration.py",
        "# says why each calibrated value is what it is. The live controller reads the same",
        "# names as VTM_<NAME> variables (e.g. VTM_UPPER).",
        "",
    ]
    for name, (_, optional) in FIELD_KINDS.items():
        text = (help or {}).get(name, "")
        if optional:
            text = f"{text} (false: {NONE_MEANS.get(name, 'off')})".strip()
        if text:
            lines.extend(textwrap.wrap(" ".join(text.split()), width=98, initial_indent="# ",
                                       subsequent_indent="# "))
        lines.append(f"{name} = {_toml_value(getattr(config, name))}")
    return "\n".join(lines) + "\n"


def load_controller_config(path: str | Path) -> ControllerConfig:
    """Read and check a controller file (``.toml`` or ``.json``); raises :class:`InvalidInput`
    naming the file (and the key) for every way it is wrong."""
    return config_from_mapping(read_config_file(path, "controller file"), source=str(path))
