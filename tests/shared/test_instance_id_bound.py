"""``instance_id`` (``VTM_INSTANCE_ID``) is checked as the schemas check the records and
reports that carry it (``shared.schemas.Id``: 1-128 characters of a-z, 0-9, '-', '_',
starting with a letter or digit). Before, any text was taken: a scheduler with a 256-character
or upper-case id started, then failed every intake delivery (its AssignmentRecord's holder)
and every window report (``WindowReport.reporter``)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from shared.schemas import Id
from shared.settings import INSTANCE_ID_MAX, ServiceSettings, hostname_token

ID = TypeAdapter(Id)


@pytest.mark.parametrize("bad", ["x" * (INSTANCE_ID_MAX + 1), "Sched-A", "-sched", "sched.a",
                                 "sched a"])
def test_an_id_the_schemas_refuse_is_refused_at_start(bad: str) -> None:
    with pytest.raises(ValidationError, match="instance_id must be"):
        ServiceSettings(instance_id=bad)
    with pytest.raises(ValidationError):
        ID.validate_python(bad)  # the records would have refused it


@pytest.mark.parametrize("good", ["sched-a", "x" * INSTANCE_ID_MAX, "0", "ctl_r-1"])
def test_an_id_the_schemas_take_is_taken(good: str) -> None:
    assert ServiceSettings(instance_id=good).instance_id == good
    assert ID.validate_python(good) == good


def test_the_hostname_stands_for_a_valid_id(monkeypatch: pytest.MonkeyPatch) -> None:
    long_name = "A" * 300 + ".example.com"
    monkeypatch.setattr("socket.gethostname", lambda: long_name)
    got = ServiceSettings(instance_id="@hostname").instance_id
    assert got is not None and got == hostname_token(long_name)[:INSTANCE_ID_MAX]
    assert ID.validate_python(got) == got


def test_an_empty_id_is_unset() -> None:
    """``VTM_INSTANCE_ID=`` (empty) is no id: the replica makes its own, as before."""
    assert ServiceSettings(instance_id="").instance_id is None
