"""Bad input on every subject of a running live stack, while it serves a replay. Prints figures.

Starts ``vertumnus up`` (sim backend, 8 GPUs, the default synthetic replay; ``--up-args`` adds
flags) on a free NATS port, waits until it is healthy, then for ``--seconds`` sends, as fast
as answers allow, a random mix of bad input to every subject the services listen on:

* bytes that are no message (random, empty, truncated, JSON nested thousands deep, msgpack
  under a JSON or msgpack ``Content-Type``, odd headers and trace contexts);
* messages one mutation away from valid (a field removed, of the wrong type, out of range,
  NaN, an extra field, another schema version), made from real messages of ``shared.schemas``;
* schema-valid messages with wrong facts (an Assignment under a stale epoch, a cache event
  far ahead of the worker's, window reports from unknown replicas);
* values written into the worker-state bucket (unknown keys; ``--kv-real``: the real
  workers' keys too) and, with ``--epoch``, into the epoch record's key;

on core subjects (cache events, window reports, epoch acks, rank control, results, KV
hand-off chunks, the drain notice), request-reply endpoints (``$SRV`` discovery, every
endpoint it lists,
worker queues and assignments, cache snapshots and commands, the gateway's completions) and
the intake stream. Then it waits for the replay to end and prints what answered how (micro
error codes per endpoint), the replay's completed / failed requests and errors, and per
service the log events and how many carried an exception. What a healthy stack shows: every
request of the replay completed, no 5xx, no exception in any log. Nothing is asserted.

    .venv/bin/python bench/fuzz_live.py [--seconds 60] [--seed 1] [--kv-real] [--epoch]
        [--up-args "--rate-scale 2 --schedulers 2"]

``--up-args`` flags come after the defaults (``--duration 900``), so they override them; with
``--backend torch`` (time scale 1) pass a shorter ``--duration`` too, e.g. ``"--backend torch
--gpus 4 --duration 80"``. Schema-valid assignments under the right epoch are real work: on
the torch backend each is a real prefill, so a long probe there also measures overload (on
this 2-core machine, two late worker heartbeats -- a lease expiry and a re-admission -- in a
40 s probe; every request still answered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.natsclient import connect  # noqa: E402
from shared.schemas import (  # noqa: E402
    EpochAck,
    EpochRecord,
    IntakeRequest,
    QueueQuery,
    WindowReport,
    WorkerState,
)
from shared.subjects import Subjects  # noqa: E402
from shared.worker import Lifecycle  # noqa: E402

S = Subjects()
NOW = time.time()
INTAKE = IntakeRequest(request_id="fz-x", input_len=1024, block_hashes=[1, 2], block_size=512,
                       arrival_s=NOW).model_dump(mode="json")
TEMPLATES: dict[str, dict[str, Any]] = {
    "intake": INTAKE,
    "completion": {"schema_version": 1, "prompt_tokens": [1, 2, 3], "max_tokens": 1},
    "assign": {"schema_version": 1, "request": INTAKE, "worker_id": "w", "epoch": 0,
               "degree": 2, "prefix_tokens": 0, "recompute_tokens": 1024, "predicted_s": 0.1,
               "assigned_at_s": NOW},
    "queue": QueueQuery(worker_id="w").model_dump(mode="json"),
    "ack": EpochAck(gpu=0, epoch=0, degree=2, worker_id="w-cp2-g0",
                    adopted_at_s=NOW).model_dump(mode="json"),
    "stored": {"schema_version": 1, "type": "stored", "worker": "w", "event_id": 1,
               "parent_hash": None, "block_hashes": [5, 6]},
    "removed": {"schema_version": 1, "type": "removed", "worker": "w", "event_id": 1,
                "block_hashes": [5]},
    "snapshot": {"type": "snapshot", "worker": "w", "last_event_id": 3, "blocks": [[5, None]]},
    "pending": {"schema_version": 1, "worker": "w", "degree": 2, "epoch": 1,
                "blocks": [[5, None, "path", None], [6, 5, "pending", "w2"],
                           [7, 6, "donor", None]]},
    "cmd": {"schema_version": 1, "command_id": "c1", "worker_id": "w", "epoch": 0,
            "blocks": [5], "op": "replicate", "source_worker": "w2"},
    "window": WindowReport(reporter="s", window_index=0, window_start_s=NOW, window_s=1.0,
                           epoch=0, demand_s=1.0, requests=1,
                           long_requests=0).model_dump(mode="json"),
    "result": {"schema_version": 1, "request_id": "fz-x", "token": 1, "finished_at_s": NOW},
    "state": WorkerState(worker_id="w-cp2-g0", degree=2, gpus=[0, 1], epoch=0,
                         lifecycle=Lifecycle.ACTIVE, queue_len=0, outstanding_s=0.0,
                         kv_free_blocks=1, kv_total_blocks=1,
                         heartbeat_s=NOW).model_dump(mode="json"),
    "epoch": EpochRecord(epoch=99, workers=[], committed_at_s=NOW).model_dump(mode="json"),
}
WEIRD: list[Any] = [None, -1, -(2**70), 2**70, 1e308, "", "x" * 5000, [], {}, [[[[]]]], True,
                    "NaN", {"a": [1, {"b": None}]}, "../..", 0.5, -0.0]


class Fuzzer:
    def __init__(self, nc: Any, rnd: random.Random, *, kv_real: bool, epoch: bool) -> None:
        self.nc, self.js, self.rnd = nc, nc.jetstream(), rnd
        self.kv_real, self.epoch = kv_real, epoch
        self.answers: Counter[tuple[str, str]] = Counter()
        self.server_errors: Counter[tuple[str, str]] = Counter()
        self.workers: list[str] = []
        self.endpoints: list[str] = []
        self.request_ids: list[str] = []

    def mutate(self, kind: str) -> bytes:
        rnd = self.rnd
        d = json.loads(json.dumps(TEMPLATES[kind]))
        key = rnd.choice(list(d))
        op = rnd.randrange(5)
        if op == 0:
            del d[key]
        elif op == 1:
            d[key] = rnd.choice(WEIRD)
        elif op == 2:
            d[f"extra_{rnd.randrange(9)}"] = 1
        elif op == 3:
            d["schema_version"] = rnd.choice([0, 2, 3, "1", None])
        else:
            d[key] = rnd.choice(WEIRD)
            d[rnd.choice(list(d))] = rnd.choice(WEIRD)
        text = json.dumps(d)
        if rnd.random() < 0.1:
            text = text.replace("0.5", "NaN").replace("1.0", "Infinity")
        return text.encode()

    def garbage(self) -> bytes:
        rnd = self.rnd
        return rnd.choice([
            lambda: os.urandom(rnd.randrange(0, 300)),
            lambda: b"",
            lambda: rnd.choice([b"[]", b"1", b'"x"', b"null", b"{}", b"NaN", b"[" * 5000]),
            lambda: msgpack.packb({"x": [1, 2, {"y": b"\xff"}]}),
            lambda: b"{" + os.urandom(50) + b"}",
            lambda: json.dumps({"schema_version": 1}).encode(),
            lambda: b"x" * rnd.choice([10_000, 500_000]),
            lambda: msgpack.packb(rnd.choice([None, -1, "", [], {}, [[[[]]]], True, 1.5])),
        ])()

    def payload(self, kind: str) -> tuple[bytes, dict[str, str] | None]:
        rnd = self.rnd
        data = self.mutate(kind) if rnd.random() < 0.5 and kind in TEMPLATES \
            else self.garbage()
        r = rnd.random()
        headers = None
        if r < 0.15:
            headers = {"Content-Type": "application/msgpack"}
        elif r < 0.25:
            headers = {"Content-Type": rnd.choice(["text/plain", "", "application/json; x"]),
                       "traceparent": rnd.choice(["garbage", "00-zz-yy-01",
                                                  "00-" + "0" * 32 + "-" + "0" * 16 + "-01"])}
        elif r < 0.3:
            headers = {"Nats-Msg-Id": "dup", "Vtm-Republished": rnd.choice(["1", "x", ""])}
        return data, headers

    async def discover(self) -> None:
        try:
            kv = await self.js.key_value(S.worker_state_bucket())
            self.workers = list(await kv.keys())
        except Exception:  # noqa: BLE001 - none yet: fake ids only
            self.workers = []
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish("$SRV.INFO", b"", reply=inbox)
        found: set[str] = set()
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:  # noqa: BLE001 - no more answers
                break
            found.update(ep["subject"] for ep in json.loads(msg.data).get("endpoints", []))
        await sub.unsubscribe()
        self.endpoints = sorted(found)

        async def tap(msg: Any) -> None:  # real request ids, for results / hand-off chunks
            try:
                self.request_ids.append(json.loads(msg.data)["request_id"])
            except Exception:  # noqa: BLE001 - msgpack or bad: not needed
                pass
            del self.request_ids[:-200]

        await self.nc.subscribe(S.intake_requests(), cb=tap)

    def worker(self) -> str:
        return self.rnd.choice(self.workers) if self.workers and self.rnd.random() < 0.8 \
            else "w-fake"

    def request_id(self) -> str:
        return self.rnd.choice(self.request_ids) if self.request_ids \
            and self.rnd.random() < 0.7 else "r-fake"

    async def one(self, n: int) -> None:
        rnd = self.rnd
        core = [
            (lambda: S.cache_events(self.worker()), rnd.choice(["stored", "removed"])),
            (lambda: S.cache_stats(rnd.choice(["s", "x"])), "window"),
            (lambda: S.cache_pending(self.worker()), "pending"),
            (lambda: S.window_demand(rnd.choice(["s", "x"])), "window"),
            (lambda: S.window_demand_again(rnd.choice(["s", "x"])), "window"),
            (lambda: S.epoch_ack(rnd.randrange(9)), "ack"),
            (lambda: S.rank_ctl(rnd.randrange(9)), "epoch"),
            (lambda: S.result(self.request_id()), "result"),
            (lambda: S.kv_handoff(self.request_id()), "result"),
            (lambda: S.ctl_drain(), "window"),
        ]
        requests = [
            (S.gateway_completions, "completion"),
            (lambda: S.worker_assign(self.worker()), "assign"),
            (lambda: S.worker_queue(self.worker()), "queue"),
            (lambda: S.cache_snapshot(self.worker()), "snapshot"),
            (lambda: S.cache_cmd(self.worker()), "cmd"),
            *((lambda e=e: e, "queue") for e in self.endpoints),
            (lambda: rnd.choice(["$SRV.PING", "$SRV.INFO", "$SRV.STATS",
                                 "$SRV.STATS.vtm-scheduler", "$SRV.INFO.vtm-rankd"]), "queue"),
        ]
        pick = rnd.random()
        try:
            if pick < 0.45:
                subject_of, kind = rnd.choice(core)
                data, headers = self.payload(kind)
                await self.nc.publish(subject_of(), data, headers=headers)
                self.answers[(subject_of().split(".")[1], "published")] += 1
            elif pick < 0.85:
                subject_of, kind = rnd.choice(requests)
                subject = subject_of()
                data, headers = self.payload(kind)
                await self._ask(subject, data, headers)
            elif pick < 0.9:
                data, headers = self.payload("intake")
                await self.js.publish(S.intake_requests(), data,
                                      headers={**(headers or {}), "Nats-Msg-Id": f"fz-{n}"})
                self.answers[("intake", "stored")] += 1
            else:
                await self.valid_but_wrong(n)
            if rnd.random() < 0.02:
                kv = await self.js.key_value(S.worker_state_bucket())
                key = rnd.choice(self.workers) if self.kv_real and self.workers \
                    and rnd.random() < 0.5 else rnd.choice(["w-fake", "w-cp2-g99"])
                await kv.put(key, self.payload("state")[0])
                self.answers[("worker-state bucket", "written")] += 1
            if self.epoch and rnd.random() < 0.005:
                kv = await self.js.key_value(S.epoch_bucket())
                await kv.put(S.epoch_key(), self.payload("epoch")[0])
                self.answers[("epoch key", "written")] += 1
        except TimeoutError:
            self.answers[("(any)", "no answer in 2 s")] += 1
        except Exception as exc:  # noqa: BLE001 - counted: no responders, a closed stack, ...
            self.answers[("(any)", type(exc).__name__)] += 1

    async def _ask(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        msg = await self.nc.request(subject, data, headers=headers, timeout=2.0)
        code = (msg.headers or {}).get("Nats-Service-Error-Code", "ok")
        # The kind (assign, queue, cmd, snapshot, ...) is the token after the group: the
        # worker id is last (conventions.md).
        rest = subject[len(S.prefix) + 1:]
        name = rest.split(".")[1] if rest.startswith(("worker.", "cache.")) else subject
        self.answers[(name, code)] += 1
        if code.startswith("5"):
            self.server_errors[(subject, (msg.headers or {}).get("Nats-Service-Error", ""))] += 1

    async def valid_but_wrong(self, n: int) -> None:
        rnd, w = self.rnd, self.worker()
        kind = rnd.randrange(3)
        if kind == 0:
            body = dict(TEMPLATES["assign"], worker_id=w, epoch=rnd.choice([0, 3, 9999]),
                        request=dict(INTAKE, request_id=f"fz-{n}", arrival_s=time.time()),
                        assigned_at_s=time.time(), degree=rnd.choice([2, 4]))
            await self._ask(S.worker_assign(w), json.dumps(body).encode(), None)
        elif kind == 1:
            body = dict(TEMPLATES["stored"], worker=w, event_id=rnd.choice([2, 10**6, 10**12]),
                        block_hashes=[rnd.randrange(1, 2**62) for _ in range(3)])
            await self.nc.publish(S.cache_events(w), json.dumps(body).encode())
            self.answers[("valid cache event, wrong id", "published")] += 1
        else:
            body = dict(TEMPLATES["window"], reporter=rnd.choice(["s", "x"]), window_index=n,
                        window_start_s=time.time() - 1)
            await self.nc.publish(S.window_demand(body["reporter"]), json.dumps(body).encode())
            self.answers[("valid window report, unknown replica", "published")] += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            nc = await connect(url, connect_timeout=1, max_reconnect_attempts=0,
                               allow_reconnect=False, error_cb=_quiet)
        except Exception:  # noqa: BLE001 - not up yet
            await asyncio.sleep(0.5)
            continue
        try:
            kv = await nc.jetstream().key_value(S.worker_state_bucket())
            if len(await kv.keys()) >= 1:
                await asyncio.sleep(3.0)  # the replay starts once every service is healthy
                return
        except Exception:  # noqa: BLE001 - bucket not there yet
            pass
        finally:
            await nc.close()
        await asyncio.sleep(0.5)
    raise SystemExit("the stack did not come up")


def log_summary(log_dir: Path) -> None:
    for log in sorted(log_dir.glob("*.log")):
        events: Counter[str] = Counter()
        exceptions = 0
        for line in log.read_text(errors="replace").splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            events[str(d.get("event", "?")).splitlines()[0][:70]] += 1
            exceptions += "exception" in d
        top = ", ".join(f"{e} {c}" for e, c in events.most_common(8))
        print(f"  {log.stem}: {exceptions} with an exception; {top}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-real", action="store_true")
    ap.add_argument("--epoch", action="store_true")
    ap.add_argument("--up-args", default="", help="more flags for `vertumnus up`")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="vtm-fuzz-"))
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vertumnus", "up", "--no-progress", "--duration", "900",
           "--nats-port", str(port), "--log-dir", str(log_dir), "--json",
           str(log_dir / "up.json"), *shlex.split(args.up_args)]
    print("stack:", " ".join(cmd[2:]))
    with open(log_dir / "up.out", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            await wait_healthy(url, proc, 120.0)
            nc = await connect(url, name="fuzz", max_reconnect_attempts=-1,
                               error_cb=_note_error, disconnected_cb=_noop)
            fz = Fuzzer(nc, random.Random(args.seed), kv_real=args.kv_real, epoch=args.epoch)
            await fz.discover()
            print(f"workers {fz.workers}; {len(fz.endpoints)} micro endpoints")
            n, end = 0, time.monotonic() + args.seconds
            while time.monotonic() < end and proc.poll() is None:
                n += 1
                await fz.one(n)
            try:
                await nc.close()
            except ConnectionError as exc:
                # The server may drop the fuzzing client itself for what it sent last (a
                # protocol error); the report below is still whole.
                CLIENT_ERRORS[f"on close: {type(exc).__name__}: {exc}"[:120]] += 1
            print(f"sent {n} in {args.seconds:.0f} s; answers by subject and code:")
            for (where, what), count in sorted(fz.answers.items()):
                print(f"  {where}: {what} {count}")
            print("5xx answers:", dict(fz.server_errors) or "none")
            print("the fuzzing client's own connection errors:", dict(CLIENT_ERRORS) or "none")
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    result = json.loads((log_dir / "up.json").read_text()) \
        if (log_dir / "up.json").exists() else {}
    print(f"replay: {result.get('completed')} completed, {result.get('failed')} failed of "
          f"{result.get('requests')}; errors {result.get('errors') or 'none'}")
    print(f"logs in {log_dir}:")
    log_summary(log_dir)


async def _quiet(exc: Exception) -> None:
    return None


CLIENT_ERRORS: Counter[str] = Counter()


async def _note_error(exc: Exception) -> None:
    CLIENT_ERRORS[f"{type(exc).__name__}: {exc}"[:120]] += 1


async def _noop() -> None:
    return None


if __name__ == "__main__":
    asyncio.run(main())
