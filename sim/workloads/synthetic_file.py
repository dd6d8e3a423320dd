"""The synthetic generator's parameters as a file: describe a workload's shape without a trace.

``vertumnus simulate --trace my-workload.toml`` (or any ``.json`` / ``.toml`` file with
``--format synthetic``) generates the built-in workload (:mod:`sim.workloads.synthetic`) with
the parameters the file gives; every field left out keeps the embedded default's value.
``vertumnus synthetic`` prints the default as such a file, with a comment on each field.
Top-level keys are the fields of :class:`~sim.workloads.synthetic.SyntheticConfig`: numbers;
length distributions as tables of ``median``, ``sigma``, ``lo``, ``hi`` (a table may give only
some of them: the rest keep that field's default); ``phases`` as a list of tables of
``duration_s``, ``rate_multiplier`` and optionally ``long_share`` (an empty list: one steady
phase at ``rate`` and ``long_share``). Example::

    rate = 6.0
    n_system_prompts = 20
    system_prompt_len = { median = 6000, sigma = 0.3 }
    phases = []

Every value is checked (a number where a number belongs, an integer where one is counted) and
the result must satisfy the generator's own bounds; errors are
:class:`~shared.ids.InvalidInput` naming the file and the key. Pure apart from
:func:`load_synthetic_config`, which reads the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Final

from shared.files import config_number, read_config_file, toml_value
from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from sim.workloads.synthetic import LogNormalLength, Phase, SyntheticConfig

_INT_FIELDS: Final[frozenset[str]] = frozenset(
    {"n_system_prompts", "long_doc_pool", "max_input_len", "block_size"})
_LENGTH_FIELDS: Final[tuple[str, ...]] = tuple(
    f.name for f in fields(SyntheticConfig) if f.type in ("LogNormalLength", LogNormalLength))

FIELD_HELP: Final[Mapping[str, str]] = {
    "duration_s": "simulated seconds of arrivals",
    "rate": "base request rate, req/s, follow-up turns included (phases multiply it)",
    "long_share": "share of conversation starts that are long document requests",
    "phases": "cycled load segments: duration_s, rate_multiplier, long_share (optional); "
              "[] = one steady phase",
    "short_len": "user tokens of a short request's first turn, after any system prompt",
    "long_len": "tokens of a long request's document",
    "output_len": "output tokens of a request",
    "n_system_prompts": "distinct shared system prompts",
    "system_prompt_len": "tokens of a system prompt",
    "system_prompt_share": "share of short conversations that start with a system prompt",
    "system_prompt_zipf": "Zipf exponent of the system prompts' popularity",
    "session_share": "share of short conversations that are multi-turn sessions",
    "mean_turns": "mean turns of a session (>= 2)",
    "turn_len": "new user tokens of a follow-up turn",
    "think_time_s": "mean seconds between a session's turns",
    "long_doc_pool": "distinct long documents (0: every long request has its own)",
    "long_doc_zipf": "Zipf exponent of the documents' popularity",
    "question_len": "tokens of the question after a document",
    "max_input_len": "longest prompt, tokens (longer ones are cut)",
    "block_size": "tokens per prefix-cache block (the simulator's profile uses 512)",
}
"""One line on each field of :class:`SyntheticConfig` (the template's comments)."""


def _table(at: str, v: Any, cls: type, base: Any | None, ints: frozenset[str]) -> Any:
    """An instance of the dataclass ``cls`` from the table ``v`` (fields left out: ``base``'s)."""
    if not isinstance(v, Mapping):
        raise InvalidInput(f"{at}: must be a table of {', '.join(f.name for f in fields(cls))}, "
                           f"got {v!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(v) - set(names))
    if unknown:
        raise InvalidInput(f"{at}: unknown field(s) {', '.join(map(repr, unknown))}; "
                           f"known: {', '.join(names)}")
    values = {k: None if x is None and k == "long_share" and cls is Phase
              else config_number(f"{at}.{k}", x, integer=k in ints) for k, x in v.items()}
    try:
        return replace(base, **values) if base is not None else cls(**values)
    except InvalidInput as exc:  # the dataclass's own checks
        raise InvalidInput(f"{at}: {exc}") from None
    except TypeError:  # a required field left out (a phase without its duration)
        missing = [n for n in names if n not in v and n != "long_share"]
        raise InvalidInput(f"{at}: missing field(s) {', '.join(missing)}") from None


def config_from_mapping(data: Any, *, source: str = "synthetic workload") -> SyntheticConfig:
    """The :class:`SyntheticConfig` a mapping describes (module docstring); ``source`` names it
    in errors. Raises :class:`InvalidInput` naming the key of the first bad value."""
    if not isinstance(data, Mapping):
        raise InvalidInput(f"{source}: must be a table of the generator's fields, got {data!r}")
    base = SyntheticConfig()
    known = [f.name for f in fields(SyntheticConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InvalidInput(f"{source}: unknown field(s) {', '.join(map(repr, unknown))}; "
                           f"known: {', '.join(known)}")
    values: dict[str, Any] = {}
    for name, v in data.items():
        at = f"{source}: {name}"
        if name in _LENGTH_FIELDS:
            values[name] = _table(at, v, LogNormalLength, getattr(base, name),
                                  frozenset({"lo", "hi"}))
        elif name == "phases":
            if not isinstance(v, list | tuple):
                raise InvalidInput(f"{at}: must be a list of tables (duration_s, "
                                   f"rate_multiplier, long_share), got {v!r}")
            values[name] = tuple(_table(f"{at}[{i}]", p, Phase, None, frozenset())
                                 for i, p in enumerate(v))
        else:
            values[name] = config_number(at, v, integer=name in _INT_FIELDS)
    try:
        return replace(base, **values)
    except InvalidInput as exc:  # the config's own checks ("SyntheticConfig: ...")
        raise InvalidInput(f"{source}: {str(exc).removeprefix('SyntheticConfig: ')}") from None


def config_to_mapping(config: SyntheticConfig) -> dict[str, Any]:
    """Every field of ``config`` as a mapping :func:`config_from_mapping` reads back to an
    equal config (a phase's ``long_share`` of None is left out)."""
    out: dict[str, Any] = {}
    for f in fields(SyntheticConfig):
        v = getattr(config, f.name)
        if f.name == "phases":
            out[f.name] = [{k: x for k, x in (("duration_s", p.duration_s),
                                               ("rate_multiplier", p.rate_multiplier),
                                               ("long_share", p.long_share)) if x is not None}
                           for p in v]
        elif isinstance(v, LogNormalLength):
            out[f.name] = {g.name: getattr(v, g.name) for g in fields(LogNormalLength)}
        else:
            out[f.name] = v
    return out


def config_to_toml(config: SyntheticConfig) -> str:
    """``config`` as a TOML file with a comment on each field (``vertumnus synthetic``)."""
    lines = ["# The synthetic workload's parameters (sim/workloads/synthetic_file.py).",
             "# Edit and run: vertumnus simulate --trace THIS.toml. A field left out keeps",
             "# the value below (the embedded default).", ""]
    for name, v in config_to_mapping(config).items():
        lines.append(f"# {FIELD_HELP[name]}")
        if name == "phases":
            rows = [f"  {toml_value(p)}," for p in v]
            lines.append("phases = [" + ("\n" + "\n".join(rows) + "\n]" if rows else "]"))
        else:
            lines.append(f"{name} = {toml_value(v)}")
    return "\n".join(lines) + "\n"


def check_block_size(got: int, want: int, *, source: str, whose: str) -> None:
    """Refuse a synthetic workload whose ``block_size`` (``got``) is not ``want``, the one
    the run that replays it counts cache blocks in (``whose`` says which that is, e.g. "the
    profile's"): :class:`InvalidInput` naming ``source`` (the file) and the field.

    The generator takes any block size >= 1 (a live ``replay`` against a gateway of another
    block size needs one), so the file alone cannot be judged: its caller, which knows
    ``want``, calls this when it reads the file. Not where the run starts: the simulator
    compares the two only once its profile is measured and its first run begins, seconds to
    minutes in and after it has written into the output directory, and a live stack never
    does (its prompts would be built from blocks of another size than the workload's
    prefixes were drawn in).
    """
    if got != want:
        left_out = " or leave it out" if want == DEFAULT_BLOCK_SIZE else ""
        raise InvalidInput(
            f"{source}: block_size is {got}, but {whose} cache blocks are {want} tokens "
            f"(every request's cached prefix is counted in them); set block_size = "
            f"{want}{left_out}")


def load_synthetic_config(path: str | Path) -> SyntheticConfig:
    """Read a synthetic workload file (``.json`` or ``.toml``, UTF-8); see the module docstring.

    Raises :class:`InvalidInput` naming the file: missing, a directory, another suffix, not
    UTF-8 or not valid JSON/TOML (:func:`~shared.files.read_config_file`), or a bad value
    (with the key). Its ``block_size`` is the caller's to compare with the run's
    (:func:`check_block_size`).
    """
    data = read_config_file(path, "synthetic workload file")
    return config_from_mapping(data, source=str(Path(path)))


__all__ = [
    "FIELD_HELP",
    "check_block_size",
    "config_from_mapping",
    "config_to_mapping",
    "config_to_toml",
    "load_synthetic_config",
]
