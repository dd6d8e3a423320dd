"""The torch backend's settings refuse a value they cannot act on, naming the variable, rather
than run on another one: ``VTM_TORCH_HANDOFF`` is ``nats`` or ``local``. Before, any other
value (``lcoal``, ``NATS``, ``none``) was taken for ``nats`` without a word (TorchPool.start
tested for ``local`` alone): a rank daemon told to decode in-process handed every KV off over
NATS instead, to a decode role it might never have been meant to run."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.rankd.torch_settings import TorchSettings, torch_settings_from_env
from shared.ids import InvalidInput


@pytest.mark.parametrize("value", ["nats", "local"])
def test_the_known_handoffs_are_taken(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert TorchSettings(handoff=value).handoff == value
    monkeypatch.setenv("VTM_TORCH_HANDOFF", value)
    assert torch_settings_from_env().handoff == value


@pytest.mark.parametrize("value", ["lcoal", "NATS", "none", ""])
def test_an_unknown_handoff_is_refused_naming_the_variable(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValidationError):
        TorchSettings(handoff=value)
    monkeypatch.setenv("VTM_TORCH_HANDOFF", value)
    with pytest.raises(InvalidInput, match="VTM_TORCH_HANDOFF") as info:
        torch_settings_from_env()
    assert repr(value) in str(info.value)
