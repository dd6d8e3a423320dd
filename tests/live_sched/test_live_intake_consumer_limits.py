"""A replica bound to an intake consumer made with another ``max_deliver`` than its own setting
(real nats-server, the scheduler in-process, no worker: every delivery finds none eligible).

Every replica shares the durable intake consumer, and an existing one keeps the configuration
it was made with (by another replica, an earlier deployment): its ``max_deliver`` is what the
server enforces. The replica judged a delivery's being the last by its own setting. With a
higher setting than the consumer's it NAK'ed the consumer's last delivery for a retry the
server never makes: the message was not delivered again, no one answered the client (it
waited for its own timeout) -- a request lost. The ack_wait had the same flaw, fixed in
session 66 (``_ack_wait_s``); the replica now keeps the consumer's own ``max_deliver`` too.
"""

from __future__ import annotations

from live_sched_support import publish_intake, results_for, wait_until
from nats.js.api import AckPolicy, ConsumerConfig

from shared.service import ensure_intake_stream
from shared.subjects import Subjects


async def test_the_consumer_s_last_delivery_answers_the_client(live, nc, uniq) -> None:  # type: ignore[no-untyped-def]
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    # Made before this replica, as another replica would have with max_deliver=2.
    await js.add_consumer(s.intake_stream(), ConsumerConfig(
        durable_name=s.intake_consumer(), ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
        max_deliver=2, max_ack_pending=1000, filter_subject=s.intake_requests()))
    sched = await live.scheduler(block_size=16, hold_s=0.0, retry_delay_s=0.05,
                                 max_deliver=5)
    got = await results_for(nc, uniq, "x")
    await publish_intake(nc, uniq, "x")
    # Two deliveries, both without an eligible worker: the second is the consumer's last.
    await wait_until(lambda: got or sched.stats.retried >= 2,
                     "x answered, or its last delivery NAK'ed")
    await wait_until(lambda: got, "x's answer on its last delivery")
    assert len(got) == 1 and got[0].token is None, got
    assert got[0].error is not None and got[0].error.startswith("not scheduled"), got
    st = sched.stats
    assert (st.retried, st.failed) == (1, 1), st
