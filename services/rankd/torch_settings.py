"""Settings of rankd's ``torch`` backend (environment ``VTM_TORCH_*``), in a module without torch.

The backend itself (services/rankd/torch_backend.py, which re-exports everything here) needs
the 'engine' extra; these settings must not: shared/envcheck.py imports
:class:`TorchSettings` to know the backend's variables by their exact names in every process,
the control-plane image (no torch) included, so that a misspelt ``VTM_TORCH_*`` name is
refused rather than ignored. This module therefore imports only pydantic and the standard
library (tests/shared/test_envcheck.py imports it with torch made unimportable).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.ids import InvalidInput

PREFIX: Final[str] = "VTM_TORCH_"
"""The prefix of the torch backend's environment variables."""

TINY_MODEL: Final[dict[str, Any]] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
}
"""A tiny random Qwen3 (dev and tests on CPU); a real deployment sets ``model_path``."""


class TorchSettings(BaseSettings):
    """Settings of the torch backend (environment ``VTM_TORCH_*``), read by rankd's torch
    backend and by ``vertumnus profile --backend torch`` (the engine rankd would run)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    model_path: str | None = Field(
        default=None, description="Local HF-format Qwen3 directory; unset: a tiny random model."
    )
    model_json: str = Field(
        default=json.dumps(TINY_MODEL),
        description="Qwen3 config (JSON) of the random model used when model_path is unset.",
    )
    seed: int = Field(default=0, description="Seed of the random model's weights.")
    dtype: str = Field(default="float32", description="float32 | float64 | bfloat16 | float16.")
    device: str = Field(default="cpu", description="'cpu' (gloo) or 'cuda' (NCCL).")
    degrees: str = Field(default="1,2,4,8", description="Lattice degrees (those > world ignored).")
    block_size: int = Field(default=16, ge=1, description="Engine cache block (page) size.")
    pages_per_rank: int = Field(default=4096, ge=1, description="KV pages per rank.")
    threads: int = Field(default=1, ge=1, description="torch intra-op threads per rank.")
    # A Literal: any other value was taken for 'nats' (the pool tests for 'local' alone).
    handoff: Literal["nats", "local"] = Field(
        default="nats",
        description="'nats': KV chunks on {prefix}.kv.{rid} to a decode role; 'local': "
        "in-process decode (dev).",
    )
    embedded_decode: bool = Field(
        default=True, description="Run a KVDecodeRole inside the rankd process (nats handoff)."
    )
    # Finite: an infinite wait would hold a request whose decode role is gone for good.
    decode_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False,
                                    description="Wait for the decode reply.")

    def model_dict(self) -> dict[str, Any]:
        return dict(json.loads(self.model_json))


class InvalidTorchSettings(InvalidInput):
    """Values of the torch backend's settings that it cannot run with: ``problems`` holds one
    line per value, each naming its ``VTM_TORCH_*`` variable and the value; ``fields`` the
    settings fields pydantic refused (empty when the problems are the pool's own checks,
    services/rankd/torch_spec.py)."""

    def __init__(self, problems: Sequence[str], fields: Sequence[str] = ()) -> None:
        super().__init__("; ".join(problems))
        self.problems: tuple[str, ...] = tuple(problems)
        self.fields: tuple[str, ...] = tuple(fields)


def _refused(exc: ValidationError) -> InvalidTorchSettings:
    """pydantic's errors as :class:`InvalidTorchSettings`: ``VTM_TORCH_X='value': why``."""
    problems, fields = [], []
    for e in exc.errors():
        if not e.get("loc"):
            problems.append(str(e["msg"]))
            continue
        fields.append(str(e["loc"][0]))
        problems.append(f"VTM_TORCH_{fields[-1].upper()}={e.get('input')!r}: {e['msg']}")
    return InvalidTorchSettings(problems, fields)


def torch_settings_from_env() -> TorchSettings:
    """``TorchSettings()`` from the environment, as rankd reads it; a value that does not
    parse raises :class:`InvalidTorchSettings` (an :class:`~shared.ids.InvalidInput`) naming
    its variable and value (not pydantic's ValidationError)."""
    try:
        return TorchSettings()
    except ValidationError as exc:
        raise _refused(exc) from None


def read_torch_settings(overrides: Mapping[str, str] | None = None,
                        ) -> tuple[TorchSettings, list[str]]:
    """The settings from the environment -- each ``VTM_TORCH_*`` variable of ``overrides``
    (a child's environment over this one's, e.g. what ``vertumnus up`` sets for its rank
    daemon) winning over the process's -- and the problems of the values pydantic refused
    (:func:`torch_settings_from_env`'s lines), with each refused field at its default in the
    settings returned, so that the other fields can still be checked (an operator then sees
    every problem at once). No problem and no overrides: exactly
    ``torch_settings_from_env()``."""
    given = {k.upper().removeprefix(PREFIX).lower(): v for k, v in (overrides or {}).items()
             if k.upper().startswith(PREFIX)}
    try:  # init values win over the environment's
        return TorchSettings(**given), []
    except ValidationError as exc:
        refused = _refused(exc)
    defaults = {f: TorchSettings.model_fields[f].get_default(call_default_factory=True)
                for f in refused.fields if f in TorchSettings.model_fields}
    try:
        return TorchSettings(**{**given, **defaults}), list(refused.problems)
    except ValidationError:  # pragma: no cover - a refusal not of one field: nothing to check
        return TorchSettings.model_construct(), list(refused.problems)


__all__ = ["PREFIX", "TINY_MODEL", "InvalidTorchSettings", "TorchSettings", "read_torch_settings",
           "torch_settings_from_env"]
