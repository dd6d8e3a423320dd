"""``vertumnus up --backend torch --gpus 4``: the whole live stack with real CP prefill.

The real command line in a child process: embedded nats-server, gateway, scheduler,
controller, cache manager and one rankd host whose four workers' ranks are four gloo
processes on this CPU running the small random-weight Qwen3 (LIVE_TORCH_MODEL) over the
short-prompt preset (``synthetic-short``, 16-token blocks). The test listens on the stack's
result subject (a port it chose) and checks every first token against single-process greedy
decoding of the same prompt, and the report / ``--json`` (every request completed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import torch

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.torch_backend import LIVE_TORCH_MODEL
from shared.schemas import FirstToken, decode
from shared.subjects import Subjects
from vertumnus.live.replay import BlockTokens, wire_id
from vertumnus.live.report import REQUIRED_KEYS
from vertumnus.live.stack import load_requests

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 240.0  # hang guard only; nothing asserts on speed
N = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_leftovers(logs: Path) -> None:
    """After a failure: SIGKILL what the run started (by pid), so nothing leaks."""
    with contextlib.suppress(OSError, ValueError):
        for name, pid in json.loads((logs / "pids.json").read_text()).items():
            if name != "orchestrator":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


async def _collect_results(url: str, subjects: Subjects, proc: subprocess.Popen[str],
                           out: dict[str, FirstToken]) -> None:
    """Connect as soon as the stack's nats-server is up and record every FirstToken until
    the run ends. Read from the results stream (which the rank daemons make before they
    publish, and where every result is stored before it counts as sent) from its first
    message, so none is missed however late this listener comes."""
    from nats.js.api import DeliverPolicy
    from nats.js.errors import NotFoundError

    deadline = time.monotonic() + WAIT_S
    nc = None
    while nc is None and proc.poll() is None:
        try:
            nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0,
                                    allow_reconnect=False)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    if nc is None:
        return

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        ft = decode(FirstToken, msg.data)
        out[ft.request_id] = ft

    js, sub = nc.jetstream(), None
    while sub is None and proc.poll() is None:
        try:
            sub = await js.subscribe(subjects.result_all(), stream=subjects.results_stream(),
                                     cb=on_msg, ordered_consumer=True,
                                     deliver_policy=DeliverPolicy.ALL)
        except NotFoundError:  # no rank daemon has made the stream yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    with contextlib.suppress(Exception):
        await nc.close()


async def test_up_backend_torch_4_ranks_reports_and_first_tokens(tmp_path: Path) -> None:
    out, logs = tmp_path / "results.json", tmp_path / "logs"
    port, prefix = free_port(), "tup"
    args = ["up", "--backend", "torch", "--gpus", "4", "--max-requests", str(N), "--rate", "4",
            "--duration", "20", "--nats-port", str(port), "--prefix", prefix,
            "--log-dir", str(logs), "--json", str(out), "--no-progress", "--stop-timeout", "10"]
    proc = subprocess.Popen([sys.executable, "-m", "vertumnus", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "COLUMNS": "120"})
    results: dict[str, FirstToken] = {}
    try:
        await _collect_results(f"nats://127.0.0.1:{port}", Subjects(prefix), proc, results)
        stdout, stderr = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
            _kill_leftovers(logs)
    assert proc.returncode == 0, stdout + stderr
    assert "TTFT" in stdout and "SLO attainment" in stdout, stdout
    data = json.loads(out.read_text())
    assert not [k for k in REQUIRED_KEYS if k not in data]
    assert data["backend"] == "torch" and data["workload"] == "synthetic-short"
    assert data["requests"] == N and data["completed"] == N, data["errors"]
    assert data["mean_ttft_s"] > 0 and 0.0 <= data["hit_rate"] <= 1.0
    assert all(code == 0 for code in data["exit_codes"].values()), data["exit_codes"]
    # Without --profile the cost model was fitted on this engine (model, 16-token blocks,
    # degrees) before the stack started, and every predicting service read it.
    assert data["profile"] == str(logs / "engine-profile" / "profile.json")
    fitted = json.loads((logs / "engine-profile" / "profile_report.json").read_text())
    assert fitted["backend"] == "torch" and fitted["block_size"] == 16
    assert fitted["degrees"] == [2, 4] and fitted["model_config"]["vocab_size"] == 151_936
    assert "engine profile" in stderr

    # First tokens: the same prompts (regenerated as `up` built them) through the model in one
    # process. The listener saw every request's result, and each must match.
    _, reqs = load_requests("synthetic-short", duration_s=20, rate=4, seed=0, max_requests=N,
                            default_rate=4)
    gen = BlockTokens(16)
    prompts = {wire_id(r): gen.prompt(r) for r in reqs}
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(LIVE_TORCH_MODEL), seed=0)
    seen = {rid: ft for rid, ft in results.items() if rid in prompts}
    assert len(seen) == N, sorted(results)
    for rid, ft in seen.items():
        assert ft.error is None, (rid, ft.error)
        want = model.reference_forward(torch.tensor(prompts[rid])).next_token
        assert ft.token == want, (rid, ft.token, want)
    # The report's hit rate is the prefixes rankd reported (= reused).
    reused = sum(ft.prefix_tokens for ft in seen.values())
    assert abs(data["hit_rate"] - reused / sum(len(p) for p in prompts.values())) < 1e-9


def _ranks_of(pid: int) -> set[int]:
    """The rank processes a rankd spawned: its live children started by multiprocessing's
    spawn (Linux /proc; multiprocessing's resource tracker is not one)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (d / "stat").read_text().rsplit(")", 1)[-1].split()
                cmd = (d / "cmdline").read_bytes()
                if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmd:
                    out.add(int(d.name))
    return out


async def test_split_then_merge_in_a_running_torch_stack(tmp_path: Path) -> None:
    """A LiveStack on the torch backend (4 gloo ranks); the test writes the epoch records a
    controller would (its window is set to an hour so it takes no decision of its own):
    2×CP2 → 4×CP1 (split) → 1×CP4 (merge). After each, requests through the gateway's HTTP
    API run on the new workers and their first tokens equal single-process greedy decoding;
    the rank processes are the same throughout."""
    from shared.schemas import EpochRecord, EpochWorker, to_json
    from shared.service import epoch_kv
    from shared.worker import GpuGroup, Lifecycle
    from vertumnus.live.http import get_json, request
    from vertumnus.live.stack import LiveStack, UpConfig

    hour = {"VTM_WINDOW_S": "3600"}
    cfg = UpConfig(gpus=4, degrees=(1, 2, 4), backend="torch", prefix="tsm",
                   initial_workers=("w-cp2-g0", "w-cp2-g2"), stop_timeout_wall_s=10,
                   health_timeout_wall_s=WAIT_S, env={"controller": hour, "scheduler": hour})
    stack = LiveStack(cfg, log_dir=tmp_path / "logs")
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(LIVE_TORCH_MODEL), seed=0)
    vocab = LIVE_TORCH_MODEL["vocab_size"]
    n_req = 0

    def prompt(seed: int, n: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    async def active(url: str) -> set[str]:
        _, body = await get_json(f"{url}/v1/workers")
        return {w["worker_id"] for w in (body or {}).get("workers", [])
                if w.get("lifecycle") == "active"}

    async def wait_active(url: str, wanted: set[str]) -> None:
        async with asyncio.timeout(WAIT_S):
            while await active(url) != wanted:
                await asyncio.sleep(0.2)

    async def complete(url: str, ids: list[int]) -> dict:
        nonlocal n_req
        n_req += 1
        body = json.dumps({"prompt": ids, "max_tokens": 1, "request_id": f"sm-{n_req}"})
        resp = await request(f"{url}/v1/completions", "POST", body.encode(), timeout_s=WAIT_S)
        assert resp.status == 200, resp.body[:500]
        out: dict = resp.json()
        return out

    async def check(url: str, degree: int, seeds: list[int]) -> None:
        base = prompt(1000, 48)  # a shared 3-block prefix: later requests may reuse it
        prompts = [base + prompt(s, 5 + s % 20) for s in seeds]
        outs = await asyncio.gather(*(complete(url, p) for p in prompts))
        for p, out in zip(prompts, outs, strict=True):
            want = model.reference_forward(torch.tensor(p)).next_token
            assert out["choices"][0]["token_ids"] == [want], out
            assert GpuGroup.from_worker_id(out["vtm"]["worker_id"]).degree == degree, out

    def record(epoch: int, *wids: str) -> bytes:
        workers = [EpochWorker(worker_id=w, first_gpu=GpuGroup.from_worker_id(w).first_gpu,
                               degree=GpuGroup.from_worker_id(w).degree,
                               lifecycle=Lifecycle.ACTIVE) for w in wids]
        return to_json(EpochRecord(epoch=epoch, workers=workers, committed_at_s=time.time(),
                                   reason="test"))

    try:
        health = await stack.start()
        url = health.gateway_url
        rankd = next(c.pid for c in stack.children.children if c.name == "rankd")
        ranks = _ranks_of(rankd)
        assert len(ranks) == 4, ranks
        assert stack.nc is not None
        kv = await epoch_kv(stack.nc.jetstream(), stack.subjects)
        e0 = EpochRecord.model_validate_json((await kv.get(stack.subjects.epoch_key())).value)
        await wait_active(url, {"w-cp2-g0", "w-cp2-g2"})
        await check(url, 2, [1, 2])

        split = ("w-cp1-g0", "w-cp1-g1", "w-cp1-g2", "w-cp1-g3")
        await kv.put(stack.subjects.epoch_key(), record(e0.epoch + 1, *split))
        await wait_active(url, set(split))
        await check(url, 1, [3, 4, 5, 6])

        await kv.put(stack.subjects.epoch_key(), record(e0.epoch + 2, "w-cp4-g0"))
        await wait_active(url, {"w-cp4-g0"})
        await check(url, 4, [7, 8])
        assert _ranks_of(rankd) == ranks  # same rank processes: no restart, no reload
    finally:
        codes = await stack.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_short_prompt_preset_is_short_shared_and_phased() -> None:
    from sim.workloads.synthetic import SHORT_BLOCK_SIZE, generate, phase_table, short_prompts

    cfg = short_prompts(120.0, 2.0)
    wl = generate(cfg, seed=3)
    lens = [r.input_len for r in wl]
    assert wl.block_size == SHORT_BLOCK_SIZE == 16 and len(wl) > 50
    assert 1 <= min(lens) and max(lens) <= 512 and sorted(lens)[len(lens) // 2] < 400
    assert all(len(r.block_hashes) == r.input_len // 16 for r in wl)
    firsts = [r.block_hashes[0] for r in wl if r.block_hashes]
    assert len(set(firsts)) < len(firsts)  # system prompts / documents are shared
    table = phase_table(cfg)
    assert table[-1]["end_s"] == 120.0 and len({row["rate"] for row in table}) > 1
    assert [r.input_len for r in generate(cfg, seed=3)] == lens  # deterministic
    assert short_prompts(60.0, 1.0, max_input_len=128).max_input_len == 128


def test_up_config_for_torch_plumbs_the_engine_settings(tmp_path: Path) -> None:
    from services.rankd.torch_backend import TorchSettings
    from vertumnus.live.stack import LiveStack, UpConfig

    assert UpConfig().workload == "synthetic" and UpConfig().block_size == 512
    cfg = UpConfig(gpus=4, backend="torch", model_path=tmp_path / "ckpt")
    assert cfg.workload == "synthetic-short" and cfg.block_size == 16
    specs = {info.name: spec for info, spec in LiveStack(cfg, log_dir=tmp_path).specs("nats://x")}
    rankd = specs["rankd"].env
    assert rankd["VTM_BACKEND"] == "torch" and rankd["VTM_TORCH_BLOCK_SIZE"] == "16"
    assert rankd["VTM_TORCH_MODEL_PATH"] == str(tmp_path / "ckpt")
    for name in ("gateway", "scheduler", "cachemgr"):
        assert specs[name].env["VTM_BLOCK_SIZE"] == "16", name
    assert specs["gateway"].env["VTM_FORWARD_TOKENS"] == "true"
    ts = TorchSettings(**{k.removeprefix("VTM_TORCH_").lower(): v
                          for k, v in rankd.items() if k.startswith("VTM_TORCH_")})
    assert ts.block_size == 16 and ts.model_path == str(tmp_path / "ckpt")
