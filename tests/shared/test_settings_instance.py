"""``instance_id = "@hostname"``: a replica id a container keeps across its restarts."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.service import SchedulerSettings
from shared.settings import HOSTNAME_INSTANCE, ServiceSettings, hostname_token
from shared.subjects import validate_token


@pytest.mark.parametrize(("host", "token"), [
    ("a1b2c3d4e5f6", "a1b2c3d4e5f6"),  # a Docker container's default hostname
    ("Scheduler-7D9F.cluster.local", "scheduler-7d9f"),
    ("sched_0", "sched_0"),
    ("host name", "host-name"),
    ("_x", "h_x"),
    ("-x", "h-x"),
    ("", "h"),
])
def test_hostname_token(host: str, token: str) -> None:
    assert hostname_token(host) == token


@given(st.text())
def test_hostname_token_is_always_a_subject_token(host: str) -> None:
    assert validate_token(hostname_token(host)) == hostname_token(host)


def test_at_hostname_stands_for_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "Sched-A.example.org")
    assert ServiceSettings(instance_id=HOSTNAME_INSTANCE).instance_id == "sched-a"
    monkeypatch.setenv("VTM_INSTANCE_ID", "@hostname")
    assert SchedulerSettings().instance_id == "sched-a"
    monkeypatch.setenv("VTM_INSTANCE_ID", "sched-b")  # any other value is kept as it is
    assert SchedulerSettings().instance_id == "sched-b"
    monkeypatch.delenv("VTM_INSTANCE_ID")
    assert SchedulerSettings().instance_id is None
