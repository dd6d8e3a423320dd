"""The sim backend: modelled time from the injected function (or the prediction), scaled."""

from __future__ import annotations

import asyncio

import pytest

from services.rankd.backend import ExecutionBackend, SimBackend, fake_token
from shared.ids import InvalidInput
from shared.schemas import Assignment, IntakeRequest


def assignment(predicted: float = 0.5) -> Assignment:
    return Assignment(
        request=IntakeRequest(request_id="r-1", input_len=100, arrival_s=1.0),
        worker_id="w-cp2-g0",
        epoch=0,
        degree=2,
        prefix_tokens=40,
        recompute_tokens=60,
        predicted_s=predicted,
        assigned_at_s=2.0,
    )


async def test_uses_injected_time_function_and_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float, *args: object) -> None:
        slept.append(delay)  # what the backend asked for; the test does not wait it out
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)

    def truth(r: int, p: int, degree: int, *, kind: str = "cp") -> float:
        calls.append((r, p, degree, kind))
        return 2.0

    backend = SimBackend(
        prefill_time=truth, handoff_time=lambda n, c: 1.0, time_scale=0.001, kind="tp"
    )
    assert isinstance(backend, ExecutionBackend)
    res = await backend.prefill(assignment())
    assert calls == [(60, 40, 2, "tp")]
    assert (res.modelled_prefill_s, res.modelled_handoff_s) == (2.0, 1.0)
    # The scale multiplies the sleeps: 2.0 s of prefill and 1.0 s of handoff at 0.001.
    assert slept == [pytest.approx(0.002), pytest.approx(0.001)]
    assert res.prefill_s >= 0 and res.kv_transfer_s >= 0
    assert res.finished_at_s >= res.started_at_s
    assert res.token == fake_token("r-1")
    # Off the worker, the later stages are reported scaled without being slept.
    slept.clear()
    off = SimBackend(prefill_time=truth, handoff_time=lambda n, c: 1.0, time_scale=0.001,
                     handoff_off_worker=True)
    res = await off.prefill(assignment())
    assert slept == [pytest.approx(0.002)]
    assert (res.kv_transfer_s, res.first_decode_s) == (pytest.approx(0.001), 0.0)


async def test_kv_transfer_and_first_decode_are_separate_consecutive_stages() -> None:
    ticks = iter(range(100))
    backend = SimBackend(
        prefill_time=lambda r, p, c, kind="cp": 2.0,
        handoff_time=lambda n, c: n / 100 / c,  # 100 tokens over degree 2: 0.5
        first_decode_time=lambda n, c: 0.25,
        time_scale=0.001,
        clock=lambda: float(next(ticks)),  # each stage boundary reads the clock once
    )
    a = assignment()
    assert backend.modelled_stages(a) == (2.0, 0.5, 0.25)
    assert backend.modelled_times(a) == (2.0, 0.75)  # handoff = KV transfer + first decode
    res = await backend.prefill(a)
    assert (res.started_at_s, res.prefill_s, res.kv_transfer_s, res.first_decode_s) == (
        0.0, 1.0, 1.0, 1.0)
    assert res.finished_at_s == res.started_at_s + res.prefill_s + res.kv_transfer_s + (
        res.first_decode_s)
    assert res.modelled_handoff_s == 0.75
    bad = SimBackend(first_decode_time=lambda n, c: -1.0)
    with pytest.raises(InvalidInput, match="first decode"):
        await bad.prefill(a)


def test_rankd_sim_times_stages_by_the_ground_truth() -> None:
    from shared.worker import WorkerKind
    from sim.groundtruth import DEFAULT_GROUND_TRUTH
    from vertumnus.live.rankd_sim import SimRankdSettings, backend_factory

    for truth in ("exact", "noisy"):
        make = backend_factory(SimRankdSettings(truth=truth, time_scale=0.01))
        backend = make("w-cp2-g0", WorkerKind.CP)
        a = assignment()
        _, kv, decode = backend.modelled_stages(a)  # type: ignore[attr-defined]
        assert kv == DEFAULT_GROUND_TRUTH.kv_handoff_time(100, 2)
        assert kv + decode == pytest.approx(DEFAULT_GROUND_TRUTH.external_time(100, 2))
        assert decode == DEFAULT_GROUND_TRUTH.surroundings.first_decode_s > 0


def test_rankd_sim_times_stages_by_a_hardware_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``VTM_HARDWARE_PATH``: the rank daemons model the file's hardware (what ``vertumnus up
    --hardware`` sets), the prefill and the first decode both."""
    from shared.worker import WorkerKind
    from sim.groundtruth import DEFAULT_GROUND_TRUTH
    from sim.hardware import load_ground_truth
    from vertumnus.live.rankd_sim import SimRankdSettings, backend_factory

    hw = tmp_path / "hw.toml"
    hw.write_text('gpu = "H200"\n[surroundings]\nfirst_decode_s = 0.02\n')
    truth = load_ground_truth(hw)
    make = backend_factory(SimRankdSettings(truth="exact", time_scale=0.01, hardware_path=hw))
    prefill, kv, decode = make("w-cp2-g0", WorkerKind.CP).modelled_stages(  # type: ignore[attr-defined]
        assignment())
    assert prefill == truth.prefill_time(60, 40, 2) < DEFAULT_GROUND_TRUTH.prefill_time(60, 40, 2)
    assert (kv, decode) == (truth.kv_handoff_time(100, 2), 0.02)


def test_rankd_sim_sizes_each_workers_cache_by_the_modelled_hbm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sim worker's cache is what its GPUs' HBM leaves for KV at its degree (as in the
    simulator), on the default hardware or a file's, in the gateway's block size; an explicit
    ``VTM_KV_TOTAL_BLOCKS`` wins."""
    from services.rankd.service import RankdService, kv_capacity
    from shared.worker import WorkerKind
    from sim.groundtruth import DEFAULT_GROUND_TRUTH
    from sim.hardware import load_ground_truth
    from vertumnus.live.rankd_sim import SimRankdSettings, backend_factory

    hw = tmp_path / "hw.toml"
    hw.write_text('gpu = "H200"\n[surroundings]\nkv_reserve_bytes = 20e9\n')
    for settings, truth in ((SimRankdSettings(), DEFAULT_GROUND_TRUTH),
                            (SimRankdSettings(truth="predicted", block_size=256),
                             DEFAULT_GROUND_TRUTH),
                            (SimRankdSettings(hardware_path=hw), load_ground_truth(hw))):
        make = backend_factory(settings)
        for wid, degree in (("w-cp2-g0", 2), ("w-cp4-g4", 4), ("w-tp4-g0", 4)):
            backend = make(wid, WorkerKind.CP)
            want = truth.kv_capacity_blocks(degree, block_size=settings.block_size)
            assert backend.kv_capacity_blocks == want  # type: ignore[attr-defined]
            assert kv_capacity(settings, backend) == want
    # Different hardware, a different capacity (the check above is not vacuous).
    default = DEFAULT_GROUND_TRUTH.kv_capacity_blocks
    assert load_ground_truth(hw).kv_capacity_blocks(2) != default(2)
    assert default(4) == 2 * default(2)
    explicit = SimRankdSettings(kv_total_blocks=100, worker_id="w-cp2-g0")
    backend = backend_factory(explicit)("w-cp2-g0", WorkerKind.CP)
    assert kv_capacity(explicit, backend) == 100
    # The worker's core gets it; a host's per-worker copy of the settings keeps "explicit".
    copied = explicit.model_copy(update={"worker_id": "w-cp4-g4"})
    assert RankdService(copied, backend).core.kv_total_blocks == 100
    assert RankdService(SimRankdSettings(worker_id="w-cp2-g0"), backend).core.kv_total_blocks \
        == DEFAULT_GROUND_TRUTH.kv_capacity_blocks(2)
    # A backend with no opinion (the torch one, the plain sim one) leaves the setting's default.
    assert kv_capacity(SimRankdSettings(), SimBackend()) == 65_536
    with pytest.raises(InvalidInput, match="kv_capacity_blocks"):
        SimBackend(kv_capacity_blocks=0)


async def test_defaults_to_prediction_and_validates() -> None:
    backend = SimBackend(time_scale=0.001)
    assert backend.modelled_times(assignment(0.25)) == (0.25, 0.0)
    bad = SimBackend(prefill_time=lambda r, p, c, kind="cp": float("nan"))
    with pytest.raises(InvalidInput):
        await bad.prefill(assignment())
    with pytest.raises(InvalidInput):
        SimBackend(time_scale=0)
    await backend.close()
    with pytest.raises(RuntimeError):
        await backend.prefill(assignment())


def test_fake_token_is_stable_and_in_vocab() -> None:
    assert fake_token("abc") == fake_token("abc")
    assert 0 <= fake_token("abc", vocab=10) < 10


def test_backend_registry_names_every_backend_the_settings_accept() -> None:
    """``BACKENDS`` is the lookup behind ``VTM_BACKEND``: both backends, nothing else. On its
    own (``python -m services.rankd.main``) the sim backend cannot reach the ground truth
    (services never import ``sim``), so it echoes the prediction with no handoff time."""
    from typing import get_args

    from services.rankd import main as rankd_main
    from services.rankd.backend import BACKENDS
    from services.rankd.settings import RankdSettings

    accepted = set(get_args(RankdSettings.model_fields["backend"].annotation))
    assert set(BACKENDS) == accepted == {"sim", "torch"}
    backend = rankd_main.make_backend(RankdSettings(backend="sim", time_scale=0.5))
    assert isinstance(backend, SimBackend) and backend.time_scale == 0.5
    assert backend.modelled_stages(assignment(0.25)) == (0.25, 0.0, 0.0)


async def test_the_ground_truth_launcher_runs_other_backends_as_the_service_main(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``vertumnus rankd`` runs the launcher whatever the backend: ``VTM_BACKEND=torch`` must
    reach the service main's real engine, not a sim backend."""
    from services.rankd import main as rankd_main
    from vertumnus.live import rankd_sim

    seen: list[tuple[object, object]] = []

    async def service_serve(settings: object, backend: object = None) -> None:
        seen.append((settings, backend))

    monkeypatch.setattr(rankd_main, "serve", service_serve)
    torch_settings = rankd_sim.SimRankdSettings(backend="torch")
    await rankd_sim.serve(torch_settings)
    # No backend handed over: the service main makes its own (the real engine's). A backend
    # passed along would run instead of it, whatever VTM_BACKEND says.
    assert seen == [(torch_settings, None)]


@pytest.mark.parametrize("argv", [["rankd"], ["rankd", "--sim-truth"]])
def test_vertumnus_rankd_runs_the_ground_truth_launcher(
        monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    """By default (``--sim-truth``, the former opt-in, still accepted and dropped)."""
    from typer.testing import CliRunner

    from vertumnus import cmd_live
    from vertumnus.cli import app

    ran: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cmd_live, "run_service_module",
                        lambda module, args, prog: ran.append((module, args)))
    res = CliRunner().invoke(app, [*argv, "--extra"])
    assert res.exit_code == 0, res.output
    assert ran == [("vertumnus.live.rankd_sim", ["--extra"])]


async def test_a_sim_backend_with_a_context_limit_refuses_and_publishes_it() -> None:
    """``max_seq_len`` on the sim backend: a longer prompt is refused before any time is
    modelled (the limit is inclusive), and the rank daemon's WorkerState carries the limit;
    without one (the default, and the ground-truth launcher's: its model has no context
    limit) the state says None, i.e. "not known"."""
    from services.rankd.service import RankdService, backend_max_seq_len
    from services.rankd.settings import RankdSettings
    from shared.schemas import MAX_TOKENS
    from shared.worker import WorkerKind
    from vertumnus.live.rankd_sim import SimRankdSettings, backend_factory

    limited = SimBackend(max_seq_len=99, time_scale=0.001)
    with pytest.raises(InvalidInput, match="prompt of 100 tokens exceeds .* max_seq_len 99"):
        await limited.prefill(assignment())
    assert (await SimBackend(max_seq_len=100, time_scale=0.001).prefill(assignment())).token \
        == fake_token("r-1")
    for bad in (0, -5, True, 2.5):
        with pytest.raises(InvalidInput, match="max_seq_len"):
            SimBackend(max_seq_len=bad)  # type: ignore[arg-type]

    settings = RankdSettings(worker_id="w-cp2-g0")
    assert RankdService(settings, limited).current_state().max_seq_len == 99
    assert RankdService(settings, SimBackend()).current_state().max_seq_len is None
    sim = backend_factory(SimRankdSettings())("w-cp2-g0", WorkerKind.CP)
    assert RankdService(settings, sim).current_state().max_seq_len is None

    # What gets published from a backend's attribute: unknown (absent, None, < 1: a torch
    # world not started) is None; a limit beyond any valid request is capped at MAX_TOKENS
    # (the schema's bound) rather than failing the state publication, the liveness heartbeat.
    class Limit:
        name = "x"

        def __init__(self, limit: object) -> None:
            self.max_seq_len = limit

    assert backend_max_seq_len(SimBackend()) is None
    for attr, want in ((None, None), (0, None), (512, 512), (MAX_TOKENS, MAX_TOKENS),
                       (1 << 40, MAX_TOKENS)):
        assert backend_max_seq_len(Limit(attr)) == want, attr  # type: ignore[arg-type]
    assert backend_max_seq_len(object()) is None  # type: ignore[arg-type]
