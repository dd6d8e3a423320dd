"""The live controller on window reports that decode but cannot be replayed (audit findings).

* A report stamped in the future (a scheduler whose clock runs ahead, a replayed message
  with a bad stamp) moved the demand windows there: every window in between closed at once
  with D = 0 (read as "merge everything"), and the windows stayed there, so real reports
  piled up as late into a window that would not close until the clock caught up.
* A report whose ``requests`` is huge was replayed as that many assignments (memory and
  event-loop time in proportion: 10**12 raised MemoryError in the subscription callback).
* A report whose window is so short that ``window_start_s / window_s`` overflows raised
  OverflowError in the callback.

Each is counted as malformed and dropped; the reports after it are counted as usual.
"""

from __future__ import annotations

import math
import time
from typing import Any

from live_ctl_support import eventually
from nats.aio.client import Client
from test_live_controller import H, inspect, settings, worker_state

from services.controller.service import ControllerService
from shared.schemas import RequestStats, WindowReport, encode, to_json
from shared.service import epoch_kv, worker_state_kv
from shared.subjects import Subjects


def report(start_s: float, *, window_s: float = H, requests: int = 10) -> WindowReport:
    return WindowReport(reporter="sched-a", window_index=0, window_start_s=start_s,
                        window_s=window_s, epoch=0, demand_s=0.5, requests=requests,
                        long_requests=0)


async def test_unreplayable_window_reports_are_rejected(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    now = time.time()
    bad = [
        report(now + 3600.0),  # an hour ahead: 18 000 windows of H
        report(math.floor(now / H) * H - H, requests=10**12),
        report(1e9, window_s=1e-300),
    ]
    good = report(math.floor(now / H) * H - H)
    for rep in [*bad, good]:
        data, headers = encode(rep)
        await nc.publish(s.window_demand("sched-a"), data, headers=headers)

    async def counted() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, b'{"decisions": 1000}')
        return body if body["counters"]["reports"] >= 1 else None

    body = await eventually(counted, what="the good report counted")
    assert body["counters"]["malformed"] == 3 and body["counters"]["reports"] == 1
    assert body["open_window"]["start_s"] <= time.time()
    assert body["reported_until_s"] <= time.time()
    assert all(d["window_start_s"] <= time.time() for d in body["decisions"])
    assert all(d["trigger"] in (None, "capacity", "long_fraction", "preference_shift",
                                "long_shift") for d in body["decisions"])
    assert ctl.counters["errors"] == 0


async def test_a_failed_record_write_does_not_stop_the_worker_state_watch(
    nc: Client, nats_server, uniq: str, services
):
    """A worker state that makes the controller write a record (a failed worker heartbeats
    again: re-admission) while JetStream cannot take the write (here the epoch bucket's
    stream is gone; in production a server restart or a JetStream leader change): the error
    is counted and the watch goes on with the next state (before, it ended the watch task,
    and with it every later heartbeat: each worker's lease then ran out)."""
    s = Subjects(uniq)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    states = await worker_state_kv(nc.jetstream(), s)
    w = "w-cp4-g0"

    def st(heartbeat_s: float) -> bytes:
        state = worker_state(w, [0, 1, 2, 3], queue=0, outstanding=0.0)
        return to_json(state.model_copy(update={"heartbeat_s": heartbeat_s}))

    await states.put(w, st(time.time() - 3600.0))  # its lease ran out long ago

    async def failed() -> bool:
        body = await inspect(nc, uniq)
        return any(x["worker_id"] == w and x["state"] == "unavailable" for x in body["workers"])

    await eventually(failed, what=f"{w} failed (lease)")
    await nc.jetstream().delete_stream(f"KV_{s.epoch_bucket()}")
    await states.put(w, st(time.time()))  # it heartbeats: re-admitted, the write fails

    watch = next(t for t in ctl._tasks if t.get_name() == "ctl-states")

    async def handled() -> bool:
        return ctl.counters["recovered"] >= 1 and (watch.done() or ctl.counters["errors"] >= 1)

    await eventually(handled, what="the re-admission's write attempted")
    assert not watch.done(), watch.exception()


async def test_a_failed_repair_does_not_stop_the_record_watch(
    nc: Client, nats_server, uniq: str, services
):
    """The record watch sees a value that is no record and writes ours over it; JetStream
    refuses the write (here the bucket's stream is sealed): the error is counted and the
    watch goes on (before, the watch task ended: records of other controllers were no longer
    followed)."""
    s = Subjects(uniq)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    watch = next(t for t in ctl._tasks if t.get_name() == "ctl-record")
    js = nc.jetstream()
    epochs = await epoch_kv(js, s)
    async with ctl._lock:  # the watch repairs only once this is released
        await epochs.put(s.epoch_key(), b"garbage")
        stream = f"KV_{s.epoch_bucket()}"
        config = (await js.stream_info(stream)).config
        config.sealed = True
        await js.update_stream(config)

    async def handled() -> bool:
        return watch.done() or ctl.counters["errors"] >= 1

    await eventually(handled, what="the repair attempted")
    assert not watch.done(), watch.exception()


async def test_a_placement_stamped_in_the_future_is_rejected(
    nc: Client, nats_server, uniq: str, services
):
    """``demand_input="assignments"``: a RequestStats stamped an hour ahead moved the demand
    windows there, as a future window report did."""
    s = Subjects(uniq)
    await services(ControllerService(
        settings(nats_server.url, uniq, "ctl-a", demand_input="assignments")))
    now = time.time()
    for i, at_s in enumerate((now + 3600.0, now)):
        st = RequestStats(request_id=f"r{i}", reporter="s1", worker_id="w-cp4-g0", degree=4,
                          input_len=1000, block_hashes=[], reused_blocks=0, prefix_tokens=0,
                          preferred_degree=4, preferred_worker="w-cp4-g0", predicted_s=0.5,
                          policy="vertumnus", at_s=at_s)
        data, headers = encode(st)
        await nc.publish(s.cache_stats("s1"), data, headers=headers)

    async def counted() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, b'{"decisions": 1000}')
        return body if body["counters"]["assignments"] >= 1 else None

    body = await eventually(counted, what="the good placement counted")
    assert body["counters"]["malformed"] == 1 and body["counters"]["assignments"] == 1
    assert body["open_window"]["start_s"] <= time.time()
    assert all(d["window_start_s"] <= time.time() for d in body["decisions"])


async def test_an_assignment_is_judged_on_its_whole_reused_blocks(
    nc: Client, nats_server, uniq: str, services
):
    """``demand_input="assignments"``: a request's preferred degree is judged on the blocks
    its worker reuses, whole (min(reused_blocks·B, L − 1)), as the simulator feeds its
    controller core and the scheduler's window reports count it. A fully cached request of 13
    blocks (L = 13·512) has P = L − 1 and reused_blocks = 12: on P = L − 1 (R = 1) no degree is
    faster, so it preferred CP2; on 12 blocks (R = 512) CP4 is more than 1.05× faster. Before,
    the controller judged it on ``prefix_tokens`` and the two counts disagreed."""
    from services.controller.core import request_preferred_degree
    from shared.costmodel import DEFAULT_PROFILE
    from shared.ids import DEFAULT_BLOCK_SIZE as B

    L, speedup = 13 * B, 1.05
    # The premise, on the pure rule both paths share.
    assert request_preferred_degree(DEFAULT_PROFILE, (2, 4), speedup, L, L - 1) == 2
    assert request_preferred_degree(DEFAULT_PROFILE, (2, 4), speedup, L, 12 * B) == 4
    s = Subjects(uniq)
    await services(ControllerService(settings(
        nats_server.url, uniq, "ctl-a", demand_input="assignments", merge_speedup=speedup,
        window_s=3600.0)))
    st = RequestStats(request_id="r0", reporter="s1", worker_id="w-cp4-g0", degree=4,
                      input_len=L, block_hashes=list(range(13)), reused_blocks=12,
                      prefix_tokens=L - 1, preferred_degree=4, preferred_worker="w-cp4-g0",
                      predicted_s=0.5, policy="vertumnus", at_s=time.time())
    data, headers = encode(st)
    await nc.publish(s.cache_stats("s1"), data, headers=headers)

    async def counted() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["counters"]["assignments"] >= 1 else None

    body = await eventually(counted, what="the placement counted")
    assert body["open_window"]["demand_by_preferred_s"] == {"4": 0.5}
    assert body["open_window"]["demand_s"] == 0.5
