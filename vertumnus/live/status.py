"""``vertumnus status``: a one-shot view of a running pool, read from NATS only.

Three sources, each read once, none written (a status read must not create the buckets the
services make, nor change anything they watch):

* the epoch record (KV ``{PREFIX}_EPOCH``, key ``current``): the committed composition;
* every worker state (KV ``{PREFIX}_WORKERS``): load, cache, counters and heartbeat age; a
  state whose heartbeat is older than the worker lease (:data:`WORKER_LEASE_S`) is *stale* --
  the bucket's TTL removes a silent worker only that long after its last write, and readers
  treat it as gone before then (shared/service.py);
* every micro service answering ``$SRV.PING`` within the timeout, kept when its metadata
  ``prefix`` is this deployment's (every :class:`~shared.service.MicroService` publishes it),
  with a warning when they report different bus protocols (metadata ``protocol``,
  :data:`shared.subjects.BUS_PROTOCOL`): a deployment upgraded one service at a time across
  a change of the bus contract, whose services no longer understand each other.

:func:`gather` does the reading (:class:`Gathered`: raw bytes and answers, read faults kept as
text); :func:`summarise` is pure and turns it into the JSON-able summary the command prints
(``--json``) or draws as tables (:func:`render`). A missing bucket, a missing or malformed
record, a malformed state and an empty PING are figures of the summary plus a notice, never
an exception: an operator asks for the status precisely when something is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Final

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shared.schemas import EpochRecord, SchemaError, WorkerState, decode
from shared.service import WORKER_LEASE_S, bucket_keys, every_answer
from shared.subjects import BUS_PROTOCOL, Subjects
from vertumnus.live.tap import connect_cli

DEFAULT_TIMEOUT_S: Final[float] = 3.0
PING_SUBJECT: Final[str] = "$SRV.PING"
PIPE_WIDTH: Final[int] = 10_000
"""The width :func:`status_console` draws at when the output is no terminal: wider than any
row, so that nothing is shrunk to fit (rich's default there is 80 columns, which cut the
workers table's ids and lifecycles: ``w-c…``, ``act…``)."""


def status_console(file: IO[str] | None = None) -> Console:
    """The console :func:`render` draws on for ``file`` (None: stdout). A terminal keeps its
    own width (a row too wide for it folds its cells, :func:`render`); anything else -- a pipe,
    a file, a CI log -- gets :data:`PIPE_WIDTH`, so every id and value is written whole, each
    row on one line, for ``grep`` and friends. Tables are never padded out to that width."""
    console = Console(file=file)
    return console if console.is_terminal else Console(file=file, width=PIPE_WIDTH)


@dataclass(frozen=True, slots=True)
class BucketRead:
    """What reading one KV bucket gave.

    ``values``: the value of each key that holds one (deleted keys and keys gone between the
    listing and the read are left out); ``found``: False when the bucket does not exist;
    ``error``: why the bucket could not be read (a timeout, no JetStream), None if it was."""

    bucket: str
    values: Mapping[str, bytes] = field(default_factory=dict)
    found: bool = True
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Gathered:
    """Everything :func:`gather` read, undecoded: the input of :func:`summarise`.

    ``pings`` are every ``$SRV.PING`` answer (JSON objects) of any deployment; ``now_s`` is
    the wall time (``time.time()``) the heartbeat ages are measured at."""

    url: str
    prefix: str
    now_s: float
    epoch: BucketRead
    workers: BucketRead
    pings: Sequence[Mapping[str, Any]] = ()
    ping_error: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S


# -- the summary (pure) -----------------------------------------------------------------------


def _note(notes: list[dict[str, str]], level: str, message: str) -> None:
    notes.append({"level": level, "message": message})


def _worker_entry(key: str, value: bytes, now_s: float, lease_s: float) -> dict[str, Any]:
    """One worker-state row: the state's figures, its heartbeat age and staleness; or, for a
    value that is no WorkerState, ``malformed`` with the decoder's words."""
    try:
        st = decode(WorkerState, value)
    except SchemaError as exc:
        return {"key": key, "malformed": True, "error": str(exc)}
    age = now_s - st.heartbeat_s
    return {
        "key": key, "malformed": False, "worker_id": st.worker_id, "kind": str(st.kind),
        "degree": st.degree, "gpus": list(st.gpus), "lifecycle": str(st.lifecycle),
        "epoch": st.epoch, "queue_len": st.queue_len, "outstanding_s": st.outstanding_s,
        "kv_free_blocks": st.kv_free_blocks, "kv_total_blocks": st.kv_total_blocks,
        "served": st.served, "hit_tokens": st.hit_tokens, "input_tokens": st.input_tokens,
        "hit_rate": st.hit_tokens / st.input_tokens if st.input_tokens else None,
        "incarnation": st.incarnation, "seq": st.seq, "heartbeat_s": st.heartbeat_s,
        "heartbeat_age_s": age, "stale": age > lease_s,
        # The engine's prompt limit (None: not published; the scheduler's setting applies).
        "max_seq_len": st.max_seq_len,
    }


def _workers(read: BucketRead, now_s: float, lease_s: float,
             notes: list[dict[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"bucket": read.bucket, "error": read.error, "entries": [],
                           "count": 0, "stale": 0, "malformed": 0}
    if read.error is not None:
        out["state"] = "unreadable"
        _note(notes, "warning", f"worker-state bucket {read.bucket} could not be read: "
                                f"{read.error}")
        return out
    if not read.found:
        out["state"] = "no-bucket"
        _note(notes, "warning", f"no worker-state bucket {read.bucket}: no rank daemon has "
                                "published a state under this prefix on this server (or every "
                                "state expired with the lease)")
        return out
    entries = [_worker_entry(k, v, now_s, lease_s) for k, v in sorted(read.values.items())]
    out["entries"] = entries
    out["count"] = len(entries)
    out["malformed"] = sum(1 for e in entries if e["malformed"])
    stale = [e["worker_id"] for e in entries if not e["malformed"] and e["stale"]]
    out["stale"] = len(stale)
    out["state"] = "ok" if entries else "empty"
    if not entries:
        _note(notes, "warning", f"worker-state bucket {read.bucket} holds no worker state "
                                "(no worker is alive, or none has heartbeated yet)")
    for e in entries:
        if e["malformed"]:
            _note(notes, "warning", f"worker state {e['key']!r} is malformed: {e['error']}")
    if stale:
        _note(notes, "warning", f"{len(stale)} stale worker state(s), heartbeat older than the "
                                f"{lease_s:g} s lease: {', '.join(stale)}")
    return out


def _epoch(read: BucketRead, key: str, now_s: float,
           by_worker: Mapping[str, Mapping[str, Any]],
           notes: list[dict[str, str]]) -> dict[str, Any]:
    """The epoch section; each composition worker says how its state looks (``reported``:
    live, stale, malformed or missing: no state under its id)."""
    out: dict[str, Any] = {"bucket": read.bucket, "error": read.error, "epoch": None,
                           "committed_at_s": None, "committed_age_s": None, "reason": None,
                           "workers": []}
    if read.error is not None:
        out["state"] = "unreadable"
        _note(notes, "warning", f"epoch bucket {read.bucket} could not be read: {read.error}")
        return out
    if not read.found:
        out["state"] = "no-bucket"
        _note(notes, "warning", f"no epoch bucket {read.bucket}: no controller or rank daemon "
                                "has run under this prefix on this server")
        return out
    value = read.values.get(key)
    if value is None:
        out["state"] = "no-record"
        _note(notes, "warning", f"epoch bucket {read.bucket} holds no record (no controller "
                                "has committed a composition yet)")
        return out
    try:
        rec = decode(EpochRecord, value)
    except SchemaError as exc:
        out["state"] = "malformed"
        out["error"] = str(exc)
        _note(notes, "warning", f"the epoch record is malformed: {exc}")
        return out
    out.update(state="ok", epoch=rec.epoch, committed_at_s=rec.committed_at_s,
               committed_age_s=now_s - rec.committed_at_s, reason=rec.reason)
    for w in sorted(rec.workers, key=lambda w: (w.first_gpu, w.degree)):
        st = by_worker.get(w.worker_id)
        reported = ("missing" if st is None else "malformed" if st["malformed"]
                    else "stale" if st["stale"] else "live")
        out["workers"].append({
            "worker_id": w.worker_id, "kind": str(w.kind), "degree": w.degree,
            "first_gpu": w.first_gpu, "gpus": list(w.group.gpus), "lifecycle": str(w.lifecycle),
            "reported": reported,
        })
    missing = [w["worker_id"] for w in out["workers"] if w["reported"] == "missing"]
    if missing:
        _note(notes, "note", f"no worker state for {', '.join(missing)} of epoch {rec.epoch}")
    return out


def _services(g: Gathered, notes: list[dict[str, str]]) -> dict[str, Any]:
    ours: list[dict[str, Any]] = []
    others = 0
    for a in g.pings:
        meta = a.get("metadata")
        meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, Mapping) else {}
        if meta.get("prefix") != g.prefix:
            others += 1  # another deployment's service, or no vertumnus one
            continue
        ours.append({"name": str(a.get("name", "?")), "id": str(a.get("id", "?")),
                     "version": str(a.get("version", "?")), "metadata": meta})
    ours.sort(key=lambda s: (s["name"], s["id"]))
    out: dict[str, Any] = {"error": g.ping_error, "entries": ours, "count": len(ours),
                           "other_prefixes": others}
    if g.ping_error is not None:
        out["state"] = "unreadable"
        _note(notes, "warning", f"{PING_SUBJECT} failed: {g.ping_error}")
    elif not ours:
        out["state"] = "none"
        elsewhere = f" ({others} service(s) of other prefixes did)" if others else ""
        _note(notes, "warning", f"no service of prefix {g.prefix!r} answered {PING_SUBJECT} "
                                f"within {g.timeout_s:g} s{elsewhere}")
    else:
        out["state"] = "ok"
    out["protocols"] = _protocols(ours, g.prefix, notes)
    return out


def _protocols(ours: Sequence[Mapping[str, Any]], prefix: str,
               notes: list[dict[str, str]]) -> dict[str, list[str]]:
    """Each bus protocol the services report (metadata ``protocol``; ``none`` for services
    older than protocols) with the names of the services reporting it; a warning when they
    differ (releases that cannot talk: shared.subjects.BUS_PROTOCOL) or when they all differ
    from this command's own."""
    by: dict[str, set[str]] = {}
    for s in ours:
        by.setdefault(s["metadata"].get("protocol", "none"), set()).add(s["name"])
    out = {p: sorted(names) for p, names in sorted(by.items())}
    if len(out) > 1:
        which = "; ".join(f"{p}: {', '.join(names)}" for p, names in out.items())
        _note(notes, "warning",
              f"services of prefix {prefix!r} speak different bus protocols ({which}): "
              "messages between them are lost or misread -- run one release of every "
              "service (upgrade them together)")
    elif out and BUS_PROTOCOL not in out:
        _note(notes, "warning",
              f"services of prefix {prefix!r} speak bus protocol {next(iter(out))}, this "
              f"vertumnus speaks {BUS_PROTOCOL}: read them with the CLI of their release")
    return out


def summarise(g: Gathered, *, lease_s: float = WORKER_LEASE_S) -> dict[str, Any]:
    """The status of one deployment as a JSON-able dict; pure (``g.now_s`` is the clock).

    Keys: ``nats``, ``prefix``, ``at_s``, ``lease_s``; ``epoch`` (``state``: ok, no-bucket,
    no-record, malformed or unreadable; the record's figures and its ``workers``, each with
    ``reported``: live, stale, malformed or missing); ``workers`` (``state``: ok, empty,
    no-bucket or unreadable; ``entries`` sorted by key, each the state's figures with
    ``heartbeat_age_s`` and ``stale`` (age > ``lease_s``), or ``malformed`` with ``error``;
    counts ``count``, ``stale``, ``malformed``); ``services`` (``state``: ok, none or
    unreadable; ``entries`` of this prefix sorted by name and id; ``other_prefixes``: answers
    left out; ``protocols``: each bus protocol reported, with its services' names);
    ``notices``: ``{"level": "warning"|"note", "message"}`` for what is missing,
    malformed or stale, in that order of sections."""
    # One list per section, joined in the order the tables are drawn (the epoch needs the
    # workers' figures first, so it cannot simply be read first).
    w_notes: list[dict[str, str]] = []
    e_notes: list[dict[str, str]] = []
    s_notes: list[dict[str, str]] = []
    workers = _workers(g.workers, g.now_s, lease_s, w_notes)
    by_worker = {e["key"] if e["malformed"] else e["worker_id"]: e for e in workers["entries"]}
    epoch = _epoch(g.epoch, Subjects(g.prefix).epoch_key(), g.now_s, by_worker, e_notes)
    services = _services(g, s_notes)
    return {"nats": g.url, "prefix": g.prefix, "at_s": g.now_s, "lease_s": lease_s,
            "epoch": epoch, "workers": workers, "services": services,
            "notices": e_notes + w_notes + s_notes}


# -- reading (async) --------------------------------------------------------------------------


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def _read_bucket(js: JetStreamContext, bucket: str,
                       keys: Sequence[str] | None = None) -> BucketRead:
    """The values of ``keys`` (None: every key) in KV ``bucket``, without creating it."""
    try:
        kv = await js.key_value(bucket)
        wanted = await bucket_keys(js, bucket) if keys is None else list(keys)
        values: dict[str, bytes] = {}
        for key in wanted:
            try:
                entry = await kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue  # deleted, or expired with the lease since the listing
            if entry.value:
                values[key] = entry.value
        return BucketRead(bucket, values)
    except (BucketNotFoundError, NotFoundError):
        # NotFoundError: bucket_keys's stream_info when the bucket went between two calls.
        return BucketRead(bucket, found=False)
    except (nats.errors.Error, TimeoutError) as exc:
        return BucketRead(bucket, found=False, error=_why(exc))


async def gather(nc: Client, subjects: Subjects, *, url: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> Gathered:
    """Read the epoch record, every worker state and every ``$SRV.PING`` answer; takes
    about ``timeout_s`` (the PING window; the KV reads run meanwhile, each JetStream request
    bounded by ``timeout_s``). Read faults are kept in the result, never raised."""
    js = nc.jetstream(timeout=timeout_s)

    async def ping() -> tuple[list[dict[str, Any]], str | None]:
        try:
            return await every_answer(nc, PING_SUBJECT, window_s=timeout_s), None
        except (nats.errors.Error, TimeoutError) as exc:
            return [], _why(exc)

    epoch, workers, (pings, ping_error) = await asyncio.gather(
        _read_bucket(js, subjects.epoch_bucket(), [subjects.epoch_key()]),
        _read_bucket(js, subjects.worker_state_bucket()),
        ping(),
    )
    # The ages are measured once everything is in: a heartbeat read early is at most the
    # window older than it looks, which errs towards calling a worker stale, never fresh.
    return Gathered(url=url, prefix=subjects.prefix, now_s=time.time(), epoch=epoch,
                    workers=workers, pings=pings, ping_error=ping_error, timeout_s=timeout_s)


async def status(url: str, prefix: str = "vtm", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 lease_s: float = WORKER_LEASE_S) -> dict[str, Any]:
    """Connect (as ``tap`` does: ``VTM_NATS_*`` credentials and TLS), gather, summarise.

    Raises ``OSError`` naming the fault when the server cannot be reached (nothing else:
    read faults are in the summary); ``SubjectError`` for an illegal ``prefix``."""
    subjects = Subjects(prefix)
    nc = await connect_cli(url, "vertumnus-status", timeout_s=timeout_s)
    try:
        g = await gather(nc, subjects, url=url, timeout_s=timeout_s)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()  # nothing published: no drain to wait for
    return summarise(g, lease_s=lease_s)


# -- rendering --------------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    if abs(seconds) < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _gpus(gpus: Sequence[int]) -> str:
    return str(gpus[0]) if len(gpus) == 1 else f"{gpus[0]}-{gpus[-1]}"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


_REPORTED_STYLE: Final[dict[str, str]] = {"live": "green", "stale": "bold red",
                                          "malformed": "bold red", "missing": "yellow"}


def _keep_whole(columns: Mapping[str, Sequence[str | None]]) -> dict[str, dict[str, Any]]:
    """``Table.add_column`` options that keep each named column's values on one line: a
    minimum width of its longest value (and header), so that a table too wide for the console
    takes the room from the figures instead -- an id or lifecycle split over lines is hard to
    read and impossible to copy. Only a console narrower than these columns folds them."""
    # A table may have no rows (an epoch record without workers): the header alone then.
    return {name: {"no_wrap": True,
                   "min_width": max([len(name), *(len(v or "") for v in vals)])}
            for name, vals in columns.items()}


def render(summary: Mapping[str, Any], console: Console) -> None:
    """The summary as a header line and up to three tables (composition, workers, services);
    a section with nothing to show is left out (its notice says why). Every text from the bus
    is printed as plain text, never as rich markup. A table too wide for ``console`` keeps its
    ids and lifecycles whole (:func:`_keep_whole`) and folds the other cells onto further
    lines instead of ending them in "…": an id or a figure cut short is a wrong one
    (:func:`status_console` gives a pipe room for every row)."""
    ep, ws, sv = summary["epoch"], summary["workers"], summary["services"]
    head = f"NATS {summary['nats']} · prefix {summary['prefix']} · {_clock(summary['at_s'])}"
    if ep["state"] == "ok":
        head += f" · epoch {ep['epoch']}"
    console.print(Text(head))

    if ep["state"] == "ok":
        reason = f": {ep['reason']}" if ep["reason"] else ""
        t = Table(title=Text(f"composition, epoch {ep['epoch']} (committed "
                             f"{_clock(ep['committed_at_s'])}, {_age(ep['committed_age_s'])} "
                             f"ago{reason})"))
        kept = _keep_whole({"worker": [w["worker_id"] for w in ep["workers"]],
                            "lifecycle": [w["lifecycle"] for w in ep["workers"]]})
        for col in ("worker", "kind", "degree", "first GPU", "GPUs", "lifecycle", "state"):
            t.add_column(col, justify="right" if col in ("degree", "first GPU") else "left",
                         overflow="fold", **kept.get(col, {}))
        for w in ep["workers"]:
            t.add_row(Text(w["worker_id"]), w["kind"], str(w["degree"]), str(w["first_gpu"]),
                      _gpus(w["gpus"]), w["lifecycle"],
                      Text(w["reported"], style=_REPORTED_STYLE.get(w["reported"], "")))
        console.print(t)

    if ws["entries"]:
        t = Table(title=f"workers ({ws['count']}; {ws['stale']} stale, {ws['malformed']} "
                        f"malformed; lease {summary['lease_s']:g} s)")
        # A malformed state's row shows its key and "malformed" in these columns.
        kept = _keep_whole({"worker": [e.get("worker_id", e["key"]) for e in ws["entries"]],
                            "lifecycle": [e.get("lifecycle", "malformed")
                                          for e in ws["entries"]]})
        for col in ("worker", "deg", "GPUs", "lifecycle", "epoch", "queue", "outst. s",
                    "KV free/total", "served", "hit/input tok", "heartbeat age"):
            t.add_column(col, justify="left" if col in ("worker", "lifecycle") else "right",
                         overflow="fold", **kept.get(col, {}))
        for e in ws["entries"]:
            if e["malformed"]:
                t.add_row(Text(e["key"]), "—", "—", Text("malformed", style="bold red"),
                          *("—",) * 7)
                continue
            rate = f" ({e['hit_rate']:.0%})" if e["hit_rate"] is not None else ""
            age = Text(_age(e["heartbeat_age_s"]))
            if e["stale"]:
                age.append(" STALE", style="bold red")
            t.add_row(Text(e["worker_id"]), str(e["degree"]), _gpus(e["gpus"]), e["lifecycle"],
                      str(e["epoch"]), str(e["queue_len"]), f"{e['outstanding_s']:.2f}",
                      f"{e['kv_free_blocks']}/{e['kv_total_blocks']}", str(e["served"]),
                      f"{e['hit_tokens']}/{e['input_tokens']}{rate}", age)
        console.print(t)

    if sv["entries"]:
        t = Table(title=f"services answering {PING_SUBJECT} ({sv['count']})")
        kept = _keep_whole({"name": [x["name"] for x in sv["entries"]],
                            "id": [x["id"] for x in sv["entries"]]})
        for col in ("name", "id", "version", "metadata"):
            t.add_column(col, overflow="fold", **kept.get(col, {}))
        for s in sv["entries"]:
            meta = " ".join(f"{k}={v}" for k, v in sorted(s["metadata"].items())
                            if k != "prefix")  # the prefix is the header's
            t.add_row(Text(s["name"]), Text(s["id"]), Text(s["version"]), Text(meta))
        console.print(t)


__all__ = ["BucketRead", "DEFAULT_TIMEOUT_S", "Gathered", "PIPE_WIDTH", "gather", "render",
           "status", "status_console", "summarise"]
