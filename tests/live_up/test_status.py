"""``vertumnus status``: the summary of what it read (pure), and the command against a real
nats-server -- an epoch record and worker states written with the services' own bucket
helpers, micro services answering ``$SRV.PING`` -- as tables and as JSON; a prefix with
nothing under it; an unreachable server."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import ServiceConfig
from typer.testing import CliRunner, Result

from shared.natsserver import EmbeddedNats
from shared.schemas import EpochRecord, EpochWorker, WorkerState, to_json
from shared.service import WORKER_LEASE_S, epoch_kv, worker_state_kv
from shared.subjects import BUS_PROTOCOL, Subjects
from shared.worker import Lifecycle
from vertumnus.cli import app
from vertumnus.live.status import BucketRead, Gathered, summarise

NOW = 1_700_000_000.0


def _record(epoch: int = 7) -> EpochRecord:
    return EpochRecord(
        epoch=epoch, committed_at_s=NOW - 30.0, reason="demand shifted to long prompts",
        workers=[EpochWorker(worker_id="w-cp2-g0", first_gpu=0, degree=2,
                             lifecycle=Lifecycle.ACTIVE),
                 EpochWorker(worker_id="w-cp4-g4", first_gpu=4, degree=4,
                             lifecycle=Lifecycle.DRAINING),
                 EpochWorker(worker_id="w-cp2-g2", first_gpu=2, degree=2,
                             lifecycle=Lifecycle.ACTIVE)])


def _states(now: float) -> tuple[WorkerState, WorkerState]:
    fresh = WorkerState(worker_id="w-cp2-g0", degree=2, gpus=[0, 1], epoch=7,
                        lifecycle=Lifecycle.ACTIVE, queue_len=3, outstanding_s=1.25,
                        kv_free_blocks=900, kv_total_blocks=1000, hit_tokens=300,
                        input_tokens=1000, served=42, max_seq_len=40_960,
                        heartbeat_s=now - 1.0)
    stale = WorkerState(worker_id="w-cp4-g4", degree=4, gpus=[4, 5, 6, 7], epoch=6,
                        lifecycle=Lifecycle.DRAINING, queue_len=0, outstanding_s=0.0,
                        kv_free_blocks=2000, kv_total_blocks=2000, served=5,
                        heartbeat_s=now - 3 * WORKER_LEASE_S)
    return fresh, stale


def _gathered(prefix: str = "vtm", **kw: Any) -> Gathered:
    subjects = Subjects(prefix)
    fresh, stale = _states(NOW)
    base: dict[str, Any] = dict(
        url="nats://example:4222", prefix=prefix, now_s=NOW, timeout_s=0.5,
        epoch=BucketRead(subjects.epoch_bucket(), {"current": to_json(_record())}),
        workers=BucketRead(subjects.worker_state_bucket(),
                           {"w-cp2-g0": to_json(fresh), "w-cp4-g4": to_json(stale),
                            "w-cp2-g2": b'{"worker_id": "w-cp2-g2"'}),
        pings=[{"name": "vtm-scheduler", "id": "B", "version": "0.1.0",
                "metadata": {"prefix": prefix, "protocol": BUS_PROTOCOL,
                             "policy": "vertumnus", "epoch": "7"}},
               {"name": "vtm-controller", "id": "A", "version": "0.1.0",
                "metadata": {"prefix": prefix, "protocol": BUS_PROTOCOL, "epoch": "7"}},
               {"name": "vtm-gateway", "id": "C", "version": "0.1.0",
                "metadata": {"prefix": "other"}},
               {"name": "someone-else", "id": "D", "version": "1.0.0", "metadata": None}])
    base.update(kw)
    return Gathered(**base)


def test_the_summary_has_every_figure_and_flags_stale_and_malformed_states() -> None:
    s = summarise(_gathered(), lease_s=WORKER_LEASE_S)
    json.dumps(s)  # what --json prints: JSON-able as it is

    ep = s["epoch"]
    assert (ep["state"], ep["epoch"], ep["committed_age_s"]) == ("ok", 7, 30.0)
    assert ep["reason"] == "demand shifted to long prompts"
    # by first GPU; each says how its worker state looks
    assert [(w["worker_id"], w["degree"], w["first_gpu"], w["lifecycle"], w["reported"])
            for w in ep["workers"]] == [("w-cp2-g0", 2, 0, "active", "live"),
                                        ("w-cp2-g2", 2, 2, "active", "malformed"),
                                        ("w-cp4-g4", 4, 4, "draining", "stale")]

    ws = s["workers"]
    assert (ws["state"], ws["count"], ws["stale"], ws["malformed"]) == ("ok", 3, 1, 1)
    by = {e["key"]: e for e in ws["entries"]}
    fresh = by["w-cp2-g0"]
    assert fresh["malformed"] is False and fresh["stale"] is False
    assert (fresh["degree"], fresh["gpus"], fresh["queue_len"], fresh["outstanding_s"],
            fresh["kv_free_blocks"], fresh["kv_total_blocks"], fresh["served"],
            fresh["hit_tokens"], fresh["input_tokens"]) == (2, [0, 1], 3, 1.25, 900, 1000,
                                                            42, 300, 1000)
    assert fresh["heartbeat_age_s"] == 1.0 and fresh["hit_rate"] == 0.3
    stale = by["w-cp4-g4"]
    assert stale["stale"] is True and stale["heartbeat_age_s"] == 3 * WORKER_LEASE_S
    assert stale["hit_rate"] is None  # no input yet: no rate, not 0 %
    # the engine's published prompt limit, or None where the backend has none
    assert fresh["max_seq_len"] == 40_960 and stale["max_seq_len"] is None
    assert by["w-cp2-g2"]["malformed"] is True and "WorkerState" in by["w-cp2-g2"]["error"]

    sv = s["services"]
    assert [(x["name"], x["id"]) for x in sv["entries"]] == [("vtm-controller", "A"),
                                                             ("vtm-scheduler", "B")]
    assert sv["other_prefixes"] == 2 and sv["entries"][1]["metadata"]["policy"] == "vertumnus"

    assert sv["protocols"] == {BUS_PROTOCOL: ["vtm-controller", "vtm-scheduler"]}

    notices = [n["message"] for n in s["notices"]]
    assert any("malformed" in n and "w-cp2-g2" in n for n in notices)
    assert any("stale" in n and "w-cp4-g4" in n and "w-cp2-g0" not in n for n in notices)
    assert not any("protocol" in n for n in notices)  # one release throughout


def _ping(name: str, sid: str, protocol: str | None) -> dict[str, Any]:
    meta = {"prefix": "vtm"} | ({} if protocol is None else {"protocol": protocol})
    return {"name": name, "id": sid, "version": "0.1.0", "metadata": meta}


def test_services_of_different_bus_protocols_are_a_warning() -> None:
    """A deployment upgraded one service at a time across a change of the bus contract (say,
    the subject rename of protocol 2) has services that do not understand each other."""
    old = "1" if BUS_PROTOCOL != "1" else "0"
    s = summarise(_gathered(pings=[_ping("vtm-scheduler", "B", BUS_PROTOCOL),
                                   _ping("vtm-rankd", "R1", None),
                                   _ping("vtm-rankd", "R2", None),
                                   _ping("vtm-gateway", "G", old)]))
    assert s["services"]["protocols"] == {BUS_PROTOCOL: ["vtm-scheduler"], old: ["vtm-gateway"],
                                          "none": ["vtm-rankd"]}
    warned = [n for n in s["notices"] if "protocol" in n["message"]]
    assert len(warned) == 1 and warned[0]["level"] == "warning"
    msg = warned[0]["message"]
    assert f"{BUS_PROTOCOL}: vtm-scheduler" in msg and f"{old}: vtm-gateway" in msg \
        and "none: vtm-rankd" in msg and "upgrade them together" in msg

    # One release throughout, but not this command's: said too (its reads may miss things).
    s = summarise(_gathered(pings=[_ping("vtm-scheduler", "B", old),
                                   _ping("vtm-gateway", "G", old)]))
    assert s["services"]["protocols"] == {old: ["vtm-gateway", "vtm-scheduler"]}
    msg = " | ".join(n["message"] for n in s["notices"])
    assert f"speak bus protocol {old}, this vertumnus speaks {BUS_PROTOCOL}" in msg


def test_the_summary_says_what_is_missing() -> None:
    sub = Subjects("dev.vtm")
    s = summarise(_gathered("dev.vtm", epoch=BucketRead(sub.epoch_bucket(), found=False),
                            workers=BucketRead(sub.worker_state_bucket(), found=False),
                            pings=[]))
    assert (s["epoch"]["state"], s["workers"]["state"], s["services"]["state"]) == (
        "no-bucket", "no-bucket", "none")
    text = " | ".join(n["message"] for n in s["notices"])
    assert "no epoch bucket DEV_VTM_EPOCH" in text and "no worker-state bucket DEV_VTM_WORKERS" \
        in text and "no service of prefix 'dev.vtm'" in text

    s = summarise(_gathered(epoch=BucketRead("VTM_EPOCH", {}),
                            workers=BucketRead("VTM_WORKERS", {})))
    assert (s["epoch"]["state"], s["workers"]["state"]) == ("no-record", "empty")
    s = summarise(_gathered(epoch=BucketRead("VTM_EPOCH", {"current": b"\xff"})))
    assert s["epoch"]["state"] == "malformed" and s["epoch"]["epoch"] is None
    assert s["notices"][0]["message"].startswith("the epoch record is malformed")
    s = summarise(_gathered(workers=BucketRead("VTM_WORKERS", found=False, error="timeout"),
                            ping_error="no responders"))
    assert (s["workers"]["state"], s["services"]["state"]) == ("unreadable", "unreadable")
    # the composition is still there; without states every worker is "missing"
    assert {w["reported"] for w in s["epoch"]["workers"]} == {"missing"}


async def _invoke(*args: str) -> Result:
    """The command in this process, in a thread: it runs its own event loop."""
    return await asyncio.to_thread(CliRunner().invoke, app, ["status", *args],
                                   env={"COLUMNS": "200"})


async def test_status_reads_the_pool_from_nats(nats_server: EmbeddedNats, nc: Client,
                                               uniq: str) -> None:
    subjects = Subjects(uniq)
    js = nc.jetstream()
    await (await epoch_kv(js, subjects)).put(subjects.epoch_key(), to_json(_record()))
    states = await worker_state_kv(js, subjects)
    fresh, stale = _states(time.time())
    for st in (fresh, stale):
        await states.put(st.worker_id, to_json(st))
    await states.put("w-cp2-g2", b"not a worker state")
    ours = await add_service(nc, ServiceConfig(
        name="vtm-controller", version="0.1.0",
        metadata={"prefix": uniq, "protocol": BUS_PROTOCOL, "epoch": "7"}))
    theirs = await add_service(nc, ServiceConfig(
        name="vtm-controller", version="0.1.0", metadata={"prefix": uniq + "x", "epoch": "1"}))
    try:
        res = await _invoke("--nats", nats_server.url, "--prefix", uniq, "--json",
                            "--timeout", "0.5")
        assert res.exit_code == 0, res.output
        s = json.loads(res.stdout)
        assert s["epoch"]["epoch"] == 7 and len(s["epoch"]["workers"]) == 3
        by = {e["key"]: e for e in s["workers"]["entries"]}
        assert by["w-cp2-g0"]["stale"] is False and by["w-cp2-g0"]["served"] == 42
        assert by["w-cp2-g0"]["heartbeat_age_s"] < WORKER_LEASE_S
        assert by["w-cp4-g4"]["stale"] is True and by["w-cp4-g4"]["epoch"] == 6
        assert by["w-cp2-g2"]["malformed"] is True
        assert [x["id"] for x in s["services"]["entries"]] == [ours.id]
        assert s["services"]["entries"][0]["metadata"]["epoch"] == "7"
        assert "stale worker state" in res.stderr and "malformed" in res.stderr
        assert "protocol" not in res.stderr  # the other prefix's service is not ours

        res = await _invoke("--nats", nats_server.url, "--prefix", uniq, "--timeout", "0.5")
        assert res.exit_code == 0, res.output
        out = res.stdout
        assert f"prefix {uniq}" in out and "composition, epoch 7" in out
        assert "demand shifted to long prompts" in out
        rows = {ln.split()[1]: ln for ln in out.splitlines()
                if ln.startswith("│ w-") and "/" in ln}  # the workers table
        assert "900/1000" in rows["w-cp2-g0"] and "300/1000 (30%)" in rows["w-cp2-g0"]
        assert "1.25" in rows["w-cp2-g0"] and "STALE" not in rows["w-cp2-g0"]
        assert "STALE" in rows["w-cp4-g4"] and "2000/2000" in rows["w-cp4-g4"]
        assert any("w-cp2-g2" in ln and "malformed" in ln for ln in out.splitlines())
        assert ours.id in out and theirs.id not in out and "epoch=7" in out
    finally:
        await ours.stop()
        await theirs.stop()


async def test_a_prefix_with_nothing_under_it_says_so(nats_server: EmbeddedNats,
                                                      uniq: str) -> None:
    res = await _invoke("--nats", nats_server.url, "--prefix", uniq, "--timeout", "0.3")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    stem = uniq.upper()
    assert f"no epoch bucket {stem}_EPOCH" in res.stderr
    assert f"no worker-state bucket {stem}_WORKERS" in res.stderr
    assert f"no service of prefix {uniq!r} answered $SRV.PING" in res.stderr
    assert f"prefix {uniq}" in res.stdout and "composition" not in res.stdout
    # ... and it created nothing: a status read leaves the server as it found it
    res = await _invoke("--nats", nats_server.url, "--prefix", uniq, "--timeout", "0.3",
                        "--json")
    s = json.loads(res.stdout)
    assert (s["epoch"]["state"], s["workers"]["state"]) == ("no-bucket", "no-bucket")


def test_an_unreachable_server_is_exit_2_naming_it() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"nats://127.0.0.1:{sock.getsockname()[1]}"
    res = CliRunner().invoke(app, ["status", "--nats", url, "--timeout", "0.3"])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: cannot reach NATS at {url}: ")
    assert res.stderr.count("\n") == 1 and not res.stdout


def test_bad_options_are_refused_before_connecting() -> None:
    for args, needle in ((["--prefix", "Bad Prefix"], "--prefix"),
                         (["--timeout", "0"], "--timeout"), (["--timeout", "nan"], "--timeout")):
        res = CliRunner().invoke(app, ["status", "--nats", "nats://127.0.0.1:9", *args])
        assert res.exit_code == 2 and needle in res.stderr, (args, res.output)
