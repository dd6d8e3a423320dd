"""The split-with-ranks trace checks hold whether or not the controller re-announces the
commit record (real nats-server, controller, cache manager and four rank daemons: the
split of reconf_trace_support.py).

A re-announcement comes when ``ack_timeout_s`` (10 s by default) passes after the commit
record with target rank acks missing -- on a stalled machine, say. The ranks adopt it and ack
it, and those acks count: before, the checks wanted each target rank counted exactly once, at
the commit, and the run's wait for the acks looked at the commit's only, so a re-announcement
failed the test or hung it until its wait ran out. Here the targets' rank daemons start only
after the controller re-announced the commit (``ack_timeout_s`` short), so every target ack
is of a re-announcement: the case made certain, not left to a stall.
"""

from __future__ import annotations

from nats.aio.client import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from reconf_trace_support import WORKERS, hex_trace, split_with_rank_daemons
from test_live_reconfig_tracing import checked_acks, roots

from services.controller.service import EPOCH_ACK_SPAN
from services.rankd.service import EPOCH_ADOPT_SPAN

ACK_TIMEOUT_S = 0.3


async def test_a_split_whose_targets_ack_a_re_announcement_passes_the_trace_checks(
        nc: Client, nats_server, uniq: str, services,  # type: ignore[no-untyped-def]
        spans: InMemorySpanExporter) -> None:
    run = await split_with_rank_daemons(nc, nats_server.url, uniq, services,
                                        spans.get_finished_spans, ack_timeout_s=ACK_TIMEOUT_S,
                                        targets_late=True)
    assert run.reannounced >= 1
    (root,) = roots(spans, run.reconfiguration)
    assert root.status.status_code is StatusCode.OK
    commit, exposed = root.attributes["vtm.epoch.after"], root.attributes["vtm.epoch.exposed"]
    assert exposed - commit > 1  # re-announced records between the commit and the exposure
    got = spans.get_finished_spans()
    adopted = {x.attributes["vtm.worker_id"] for x in got
               if x.name == EPOCH_ADOPT_SPAN and x.attributes["vtm.epoch"] == exposed}
    assert adopted == set(WORKERS)
    checked_acks(got, hex_trace(root), commit, exposed)
    # The targets' acks that counted are all of re-announcements: what the old check refused.
    assert {x.attributes["vtm.epoch"] for x in got if x.name == EPOCH_ACK_SPAN
            and x.attributes.get("vtm.ack.outcome") == "counted"} <= set(
        range(commit + 1, exposed))
