"""``vertumnus status`` writes every id and value whole: piped or redirected (no terminal)
each row on one line, however many columns; on a terminal too narrow for a row its cells fold
onto the next line instead of ending in "…". Before, output that was no terminal was cut to
rich's 80 columns (``w-c…``, ``act…``), so ``vertumnus status | grep w-cp4-g12`` found nothing.

Against a real nats-server: the epoch record and worker states written with the services'
own bucket helpers."""

from __future__ import annotations

import asyncio
import io
import time

from nats.aio.client import Client
from rich.console import Console
from typer.testing import CliRunner, Result

from shared.natsserver import EmbeddedNats
from shared.schemas import EpochRecord, EpochWorker, WorkerState, to_json
from shared.service import epoch_kv, worker_state_kv
from shared.subjects import Subjects
from shared.worker import Lifecycle
from vertumnus.cli import app
from vertumnus.live.status import BucketRead, Gathered, render, status_console, summarise

IDS = ("w-cp4-g12", "w-cp2-g10", "w-cp8-g16")


def _states(now: float) -> list[WorkerState]:
    return [WorkerState(worker_id=wid, degree=int(wid[4]), gpus=list(range(int(wid[4]))),
                        epoch=12, lifecycle=Lifecycle.DRAINING if k else Lifecycle.ACTIVE,
                        queue_len=123, outstanding_s=12.5, kv_free_blocks=1_234_567,
                        kv_total_blocks=2_345_678, hit_tokens=9_876_543,
                        input_tokens=12_345_678, served=98_765, heartbeat_s=now - 1.0)
            for k, wid in enumerate(IDS)]


def _record() -> EpochRecord:
    return EpochRecord(epoch=12, committed_at_s=time.time() - 5.0, reason="load",
                       workers=[EpochWorker(worker_id=wid, first_gpu=int(wid.split("g")[-1]),
                                            degree=int(wid[4]), lifecycle=Lifecycle.ACTIVE)
                                for wid in IDS])


async def _invoke(*args: str) -> Result:
    """The command in this process, in a thread (it runs its own event loop), its output no
    terminal and no COLUMNS set: as in ``vertumnus status | less``."""
    return await asyncio.to_thread(CliRunner().invoke, app, ["status", *args],
                                   env={"COLUMNS": None, "LINES": None})


async def test_piped_status_writes_every_row_whole(nats_server: EmbeddedNats, nc: Client,
                                                   uniq: str) -> None:
    subjects = Subjects(uniq)
    js = nc.jetstream()
    await (await epoch_kv(js, subjects)).put(subjects.epoch_key(), to_json(_record()))
    states = await worker_state_kv(js, subjects)
    for st in _states(time.time()):
        await states.put(st.worker_id, to_json(st))
    res = await _invoke("--nats", nats_server.url, "--prefix", uniq, "--timeout", "0.5")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "…" not in out, out
    rows = [ln for ln in out.splitlines() if "1234567/2345678" in ln]  # the workers table
    assert len(rows) == len(IDS), out
    for wid, row in zip(sorted(IDS), sorted(rows, key=lambda r: r.split()[1]), strict=True):
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        assert cells[0] == wid and cells[3] in ("active", "draining"), row
        assert "9876543/12345678 (80%)" in row and "98765" in row, row
    # Room for every row, but nothing padded out to it.
    assert max(len(ln) for ln in out.splitlines()) < 300, out


def _summary(now: float, *, malformed: bool = False) -> dict[str, object]:
    subjects = Subjects("vtm")
    states = {st.worker_id: to_json(st) for st in _states(now)}
    if malformed:
        states["w-cp1-g31-not-a-state"] = b"{"
    return summarise(Gathered(
        url="nats://example:4222", prefix="vtm", now_s=now, timeout_s=0.5,
        epoch=BucketRead(subjects.epoch_bucket(), {"current": to_json(_record())}),
        workers=BucketRead(subjects.worker_state_bucket(), states),
        pings=[{"name": "vtm-scheduler", "id": "NCXQ3ZL2ZC5Q4J2A9D1FGH", "version": "0.1.0",
                "metadata": {"prefix": "vtm"}}]))


def test_a_narrow_terminal_keeps_ids_whole_and_cuts_nothing() -> None:
    """A terminal keeps its width: the figures fold onto further lines to make room, the ids
    and lifecycles stay whole on their row, and no cell ends in "…"."""
    buf = io.StringIO()
    render(_summary(time.time(), malformed=True),
           Console(file=buf, width=80, force_terminal=True, color_system=None))
    out = buf.getvalue()
    assert "…" not in out, out
    assert max(len(ln) for ln in out.splitlines()) <= 80, out
    lines = out.splitlines()
    for wid in (*IDS, "w-cp1-g31-not-a-state", "NCXQ3ZL2ZC5Q4J2A9D1FGH"):
        assert any(wid in ln for ln in lines), (wid, out)
    assert sum("draining" in ln for ln in lines) == 2, out  # the workers table's rows
    assert any("w-cp1-g31-not-a-state" in ln and "malformed" in ln for ln in lines), out


def test_the_console_is_wide_off_a_terminal() -> None:
    off = status_console(io.StringIO())
    assert not off.is_terminal and off.width >= 1000
