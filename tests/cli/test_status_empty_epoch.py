"""``vertumnus status`` on an epoch record with no workers (a valid record: the schema asks
for none) shows the empty composition and exits 0. The column widths that keep ids whole
were taken as ``max(len(header), *values)``, which with no values is ``max(int)``: a
TypeError traceback instead of the status.

Against a real nats-server: the record written with the services' own bucket helper."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from typer.testing import CliRunner

from shared.natsserver import EmbeddedNats
from shared.schemas import EpochRecord, to_json
from shared.service import epoch_kv
from shared.subjects import Subjects
from vertumnus.cli import app


async def test_status_shows_an_epoch_record_without_workers(nats_server: EmbeddedNats,
                                                            nc: Client, uniq: str) -> None:
    subjects = Subjects(uniq)
    record = EpochRecord(epoch=3, committed_at_s=time.time() - 1.0, reason="empty", workers=[])
    await (await epoch_kv(nc.jetstream(), subjects)).put(subjects.epoch_key(), to_json(record))
    res = await asyncio.to_thread(
        CliRunner().invoke, app,
        ["status", "--nats", nats_server.url, "--prefix", uniq, "--timeout", "0.5"],
        env={"COLUMNS": None, "LINES": None})
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 0, res.output
    assert "composition, epoch 3" in res.stdout, res.stdout
