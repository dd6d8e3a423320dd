"""OpenTelemetry metrics: the provider set up once, the exporter chosen by settings, and what
the gateway, the controller and the cache manager record (their instruments, driven directly;
tests/live_sched/test_live_metrics.py drives the gateway's end to end)."""

from __future__ import annotations

import pytest
from metricsread import points, total
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader
from pydantic import ValidationError

from services.cachemgr.actions import Demote, Reclaim, Replicate
from services.cachemgr.metrics import CacheMetrics, action_kind
from services.controller.lattice import OpKind
from services.controller.lifecycle import Phase, Reconfiguration
from services.controller.metrics import PoolMetrics
from services.gateway.metrics import RequestMetrics, degree_label
from shared import metrics as vm
from shared.schemas import FirstToken, TtftStages
from shared.settings import TelemetrySettings
from shared.slo import QWEN3_SLO, parse_slo
from shared.worker import GpuGroup


def test_the_provider_is_set_up_once(metric_reader: InMemoryMetricReader) -> None:
    first = vm.setup_metrics("x")
    assert isinstance(first, MeterProvider)
    assert vm.setup_metrics("y", reader=InMemoryMetricReader()) is first
    vm.meter().create_counter("vtm.test.once").add(3, {"k": "v"})
    assert points(metric_reader, "vtm.test.once") == {(("k", "v"),): 3}


def test_the_exporter_follows_the_settings() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter as Grpc,
    )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as Http,
    )

    assert vm._exporter(TelemetrySettings()) is None
    assert isinstance(vm._exporter(TelemetrySettings(metrics_exporter="console")),
                      ConsoleMetricExporter)
    http = vm._exporter(TelemetrySettings(
        metrics_exporter="otlp", metrics_endpoint="http://p:9090/api/v1/otlp/v1/metrics"))
    assert isinstance(http, Http)
    assert isinstance(vm._exporter(TelemetrySettings(metrics_exporter="otlp",
                                                     metrics_protocol="grpc")), Grpc)
    for bad in ({"metrics_exporter": "prometheus"}, {"metrics_interval_s": 0},
                {"metrics_protocol": "udp"}):
        with pytest.raises(ValidationError):
            TelemetrySettings(**bad)


def _result(worker: str | None, reused: int, prefill: float = 0.3) -> FirstToken:
    return FirstToken(request_id="r", token=7, worker_id=worker, prefix_tokens=reused,
                      stages=TtftStages(intake_wait_s=0.01, schedule_s=0.002,
                                        queue_wait_s=0.1, prefill_s=prefill,
                                        kv_transfer_s=0.02, first_decode_s=0.03, total_s=0.5),
                      finished_at_s=1.0)


def test_request_metrics_give_hit_rate_and_slo_attainment(
        metric_reader: InMemoryMetricReader) -> None:
    rm = RequestMetrics(parse_slo("8192:1,inf:5"))
    before = {n: total(metric_reader, n, degree="4") for n in
              ("vtm.request.input_tokens", "vtm.request.reused_tokens", "vtm.request.slo_tokens",
               "vtm.request.ttft")}
    stage_before = total(metric_reader, "vtm.request.stage", stage="prefill")
    nats_ok = total(metric_reader, "vtm.gateway.completions", entry="nats", status="200")
    rm.answered(_result("w-cp4-g12", 2048), 4000, 0.6, "http")  # met (1 s)
    rm.answered(_result("w-cp4-g12", 0), 10_000, 6.0, "http")  # missed (5 s)
    rm.answered(_result("w-cp4-g12", 99_999), 1000, 0.2, "nats")  # reuse capped at the length
    got = {n: total(metric_reader, n, degree="4") - v for n, v in before.items()}
    assert got == {"vtm.request.input_tokens": 15_000, "vtm.request.reused_tokens": 3048,
                   "vtm.request.slo_tokens": 5000, "vtm.request.ttft": 3}
    assert total(metric_reader, "vtm.request.stage", stage="prefill") - stage_before == 3
    assert total(metric_reader, "vtm.gateway.completions", entry="nats",
                 status="200") == nats_ok + 1
    n = total(metric_reader, "vtm.gateway.completions", status="503", entry="http")
    rm.refused(503, "http")
    assert total(metric_reader, "vtm.gateway.completions", status="503", entry="http") == n + 1


def test_a_refused_request_with_a_known_length_is_an_slo_miss(
        metric_reader: InMemoryMetricReader) -> None:
    rm = RequestMetrics(parse_slo("8192:1,inf:5"))
    names = ("vtm.request.input_tokens", "vtm.request.slo_tokens")
    before = {n: total(metric_reader, n) for n in names}
    answered = total(metric_reader, "vtm.request.input_tokens", status="200")
    unplaced = total(metric_reader, "vtm.request.input_tokens", degree="?", status="504")
    rm.answered(_result("w-cp4-g12", 0), 3000, 0.2, "http")  # met
    rm.refused(504, "http", 1000)  # tokenized, no first token in time: a miss
    rm.refused(503, "nats", 2000)  # tokenized, not scheduled: a miss
    rm.refused(400, "http")  # malformed: no length, no tokens
    got = {n: total(metric_reader, n) - v for n, v in before.items()}
    # Attainment = slo / input tokens over every status: 3000 / 6000, not 3000 / 3000.
    assert got == {"vtm.request.input_tokens": 6000, "vtm.request.slo_tokens": 3000}
    assert total(metric_reader, "vtm.request.input_tokens", status="200") - answered == 3000
    assert total(metric_reader, "vtm.request.input_tokens", degree="?",
                 status="504") - unplaced == 1000


def test_degree_label() -> None:
    assert degree_label("w-cp2-g6") == "2" and degree_label("w-tp4-g0") == "4"
    assert degree_label(None) == degree_label("") == degree_label("worker-7") == "?"


def test_pool_metrics(metric_reader: InMemoryMetricReader) -> None:
    # Degrees no other test's pool has: other controllers of this process report too.
    counts: dict[int, int] | None = None
    pm = PoolMetrics(lambda: counts)
    assert (("degree", "16"),) not in points(metric_reader, "vtm.pool.workers")  # not leading
    counts = {16: 3, 32: 1}
    workers = points(metric_reader, "vtm.pool.workers")
    assert workers[(("degree", "16"),)] == 3 and workers[(("degree", "32"),)] == 1

    def recon(aborted: bool) -> Reconfiguration:
        return Reconfiguration(
            id=1, kind=OpKind.MERGE, sources=(GpuGroup(0, 2), GpuGroup(2, 2)),
            targets=(GpuGroup(0, 4),), phase=Phase.ABORTED if aborted else Phase.EXPOSED,
            epoch=3, started_at=10.0, drained_at=None if aborted else 12.5,
            switch_started_at=None, exposed_at=None if aborted else 13.0,
            aborted_at=11.0 if aborted else None, in_flight={}, awaiting_acks=(),
            failed_targets=(), redirected=0)

    before = total(metric_reader, "vtm.pool.reconfigurations", kind="merge", outcome="exposed")
    aborted = total(metric_reader, "vtm.pool.reconfigurations", kind="merge", outcome="aborted")
    drains = points(metric_reader, "vtm.pool.reconfiguration.drain").get((("kind", "merge"),),
                                                                          (0, 0.0))
    switches = points(metric_reader, "vtm.pool.reconfiguration.switch").get(
        (("kind", "merge"),), (0, 0.0))
    pm.ended(recon(aborted=False))
    pm.ended(recon(aborted=True))
    assert total(metric_reader, "vtm.pool.reconfigurations", kind="merge",
                 outcome="exposed") == before + 1
    assert total(metric_reader, "vtm.pool.reconfigurations", kind="merge",
                 outcome="aborted") == aborted + 1
    count, s = points(metric_reader, "vtm.pool.reconfiguration.drain")[(("kind", "merge"),)]
    assert (count - drains[0], s - drains[1]) == (1, pytest.approx(2.5))  # aborted: no drain
    count, s = points(metric_reader, "vtm.pool.reconfiguration.switch")[(("kind", "merge"),)]
    assert (count - switches[0], s - switches[1]) == (1, pytest.approx(0.5))  # 12.5 -> 13.0


def test_a_gauge_asks_every_live_owner(metric_reader: InMemoryMetricReader) -> None:
    """Two owners of one gauge both report (OpenTelemetry would keep only the first callback);
    an owner that is gone no longer does."""
    import gc

    class Owner:
        def __init__(self, v: int) -> None:
            self.v = v

        def observe(self) -> list[Observation]:
            return [Observation(self.v, {"owner": str(self.v)})]

    a, b = Owner(1), Owner(2)
    for o in (a, b):
        vm.observe_gauge("vtm.test.gauge", "{x}", "test", o, Owner.observe)
    assert points(metric_reader, "vtm.test.gauge") == {(("owner", "1"),): 1,
                                                       (("owner", "2"),): 2}
    del b, o  # the loop variable held it too
    gc.collect()
    assert points(metric_reader, "vtm.test.gauge") == {(("owner", "1"),): 1}
    assert a.v == 1


def test_cache_metrics(metric_reader: InMemoryMetricReader) -> None:
    cm = CacheMetrics(lambda: 17)
    assert 17 in points(metric_reader, "vtm.cache.trie_nodes").values()
    rep = Replicate(node_hash=3, degree=2, source="w-cp2-g0", dest="w-cp2-g2",
                    blocks=(1, 2, 3), kind="inter")
    rec = Reclaim(worker="w-cp2-g0", node_hash=3, blocks=(3,))
    dem = Demote(worker="w-cp2-g0", blocks=(1, 2))
    assert (action_kind(rep), action_kind(rec), action_kind(dem)) == ("inter", "reclaim", "demote")
    before = total(metric_reader, "vtm.cache.blocks", kind="inter")
    failed = total(metric_reader, "vtm.cache.commands", kind="reclaim", outcome="failed")
    cm.done(rep, ok=True)
    cm.done(rec, ok=False)
    assert total(metric_reader, "vtm.cache.blocks", kind="inter") == before + 3
    assert total(metric_reader, "vtm.cache.commands", kind="reclaim",
                 outcome="failed") == failed + 1
    demoted = total(metric_reader, "vtm.cache.blocks", kind="demote")
    cm.done(dem, ok=True)
    assert total(metric_reader, "vtm.cache.blocks", kind="demote") == demoted + 2


def test_request_metrics_use_the_gateways_slo_setting() -> None:
    from services.gateway.settings import GatewaySettings

    assert GatewaySettings().slo_table.bounds == QWEN3_SLO.bounds
    assert GatewaySettings(slo="deepseek-v4-flash").slo_table.name == "deepseek-v4-flash"
    with pytest.raises(ValidationError, match="unknown SLO table"):
        GatewaySettings(slo="fast")


def test_a_replica_exports_under_its_own_instance_id() -> None:
    """``service.instance.id`` on the resource of both providers: the settings' replica id, or
    ``host:pid`` without one, so two replicas of a service (``docker compose up --scale
    scheduler=2``) export distinct metric series and distinguishable spans. Run in a fresh
    process: the providers are set up once per process (the tests' own by conftest)."""
    import json
    import subprocess
    import sys

    from shared.telemetry import service_resource

    given = service_resource("vtm-scheduler", "sched-a").attributes
    assert given["service.name"] == "vtm-scheduler"
    assert given["service.instance.id"] == "sched-a"
    assert service_resource("vtm-scheduler").attributes["service.instance.id"].endswith(
        f":{__import__('os').getpid()}")
    code = (
        "import json\n"
        "from shared.metrics import setup_metrics\n"
        "from shared.telemetry import setup_tracing\n"
        "t = setup_tracing('vtm-x', instance_id='rep-1')\n"
        "m = setup_metrics('vtm-x', instance_id='rep-1')\n"
        "attrs = [t.resource.attributes, m._sdk_config.resource.attributes]\n"
        "print(json.dumps([dict(a) for a in attrs]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    for attrs in json.loads(out.stdout.strip().splitlines()[-1]):
        assert attrs["service.name"] == "vtm-x"
        assert attrs["service.instance.id"] == "rep-1"
