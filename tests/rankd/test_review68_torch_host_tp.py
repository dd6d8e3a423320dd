"""A torch rank *host* (``VTM_HOST_GPUS``) whose initial workers would start as TP
(``VTM_KIND=tp``) exits 2 before any rank spawns, as a single TP worker does
(test_rankd_torch_settings_start.py).

Found by a review of session 68's torch settings check: ``torch_problems`` refused
``VTM_KIND=tp`` for a single worker only, yet a host starts its initial workers in
``VTM_KIND`` too (services/rankd/host.py), and the torch backend refuses TP
(``TorchBackend``): the world was spawned, then the first worker's start failed -- the very
failure the check exists to say first. A host without initial workers starts its workers from
the epoch record, each in the record's kind: ``VTM_KIND`` is not used, so not refused."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("torch")

from services.rankd import main as rankd_main  # noqa: E402
from services.rankd import torch_world  # noqa: E402

pytestmark = pytest.mark.torch


class Spawned(Exception):
    """Raised by the stubbed world start: the daemon got as far as spawning ranks."""


@pytest.fixture
def tp_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch host of GPUs 0-1 in ``VTM_KIND=tp`` (on cpu), NATS nowhere, and a world that
    raises :class:`Spawned` instead of starting."""
    for name in list(os.environ):
        if name.upper().startswith("VTM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VTM_NATS_URL", "nats://127.0.0.1:9")
    monkeypatch.setenv("VTM_BACKEND", "torch")
    monkeypatch.setenv("VTM_HOST_GPUS", "0-1")
    monkeypatch.setenv("VTM_KIND", "tp")

    def spawn(self: Any) -> Any:
        raise Spawned(self.spec)

    monkeypatch.setattr(torch_world.TorchWorld, "start", spawn)


def test_a_tp_host_with_initial_workers_exits_2(
        tp_host: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VTM_INITIAL_WORKERS", "w-cp1-g0")
    with pytest.raises(SystemExit) as info:  # before the fix: Spawned
        rankd_main.main([])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "invalid settings" in err and "Traceback" not in err, err
    assert "VTM_KIND" in err and "'tp'" in err and "CP workers only" in err, err


def test_a_tp_host_without_initial_workers_is_not_refused(tp_host: None) -> None:
    """Its workers come from the epoch record, in the record's kinds: the check main runs
    first passes, and the pool gets as far as the world's spawn. (Not through ``main``: past
    the check it runs the service, whose exit shuts down this process's tracing, which the
    tests after this one in the process share.)"""
    from services.rankd.torch_backend import TorchPool

    settings = rankd_main.parse_settings([])
    rankd_main.check_torch_settings(settings, "rankd")  # returns: nothing to refuse
    with pytest.raises(Spawned):
        TorchPool.start(settings.host_range, initial_workers=settings.initial_worker_ids)
