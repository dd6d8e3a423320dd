"""docker-compose.yml and Dockerfile, checked without a Docker engine.

* Structure: the file validates against ``data/compose-subset.schema.json``, a hand-written
  JSON schema of the subset of the Compose Specification this project uses (the upstream
  compose-spec schema is not vendored: it cannot be downloaded at test time). Unknown keys are
  rejected, so the subset grows only deliberately.
* Meaning: the infrastructure services are there (nats with JetStream and monitoring, Jaeger
  with OTLP 4317/4318 and UI 16686, nats-box); every vertumnus service runs ``python -m`` on a
  module that exists, and every ``VTM_*`` variable it sets is a real setting of that service
  whose value the settings class accepts.
* The fitted profile: a one-shot ``profile`` service runs ``vertumnus profile --backend sim``
  into a named volume, and every service that reads ``VTM_PROFILE_PATH`` (scheduler,
  controller, cache manager) waits for it to complete and loads the file it wrote; that
  command really runs and writes a profile covering the pool's degrees.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml
from live_up_support import REPO
from typer.testing import CliRunner

from services.controller.lattice import Composition
from shared.costmodel import Profile
from sim.profiling import PROFILE_FILE
from vertumnus.cli import app
from vertumnus.live.registry import SERVICES, SIM_RANKD, ServiceInfo, env_names, module_runnable

COMPOSE = REPO / "docker-compose.yml"
SCHEMA = Path(__file__).parent / "data" / "compose-subset.schema.json"
VTM_SERVICES = ("gateway", "scheduler", "controller", "cachemgr", "rankd")
PROFILED = ("scheduler", "controller", "cachemgr")  # the services that read VTM_PROFILE_PATH


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # resolves the << merge keys
    assert isinstance(data, dict)
    return data


def _info_for(module: str) -> ServiceInfo | None:
    for info in (*SERVICES.values(), SIM_RANKD):
        if info.module == module:
            return info
    return None


def test_validates_against_the_compose_subset_schema(compose: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_rejects_what_compose_rejects() -> None:
    # The schema is a real check, not a pass-through.
    schema = json.loads(SCHEMA.read_text())
    bad = [
        {"services": {"a": {"image": "x", "comand": ["typo"]}}},
        {"services": {"a": {"command": ["no", "image", "or", "build"]}}},
        {"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "ready"}}}}},
        {"services": {"a": {"image": "x", "ports": ["80:eighty"]}}},
        {"services": {"a": {"image": "x"}}, "servics": {}},
    ]
    for doc in bad:
        assert list(jsonschema.Draft7Validator(schema).iter_errors(doc)), doc


def test_third_party_images_are_pinned(compose: dict[str, Any]) -> None:
    """Every image not built here names a release: a floating tag (``latest``, none) lets a
    new upstream default change under the pool, e.g. the address Jaeger's OTLP receiver binds
    or the flag that turns Prometheus' OTLP receiver on."""
    for name, svc in compose["services"].items():
        image = svc.get("image", "")
        if not image or image.startswith("vertumnus:"):
            continue
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and any(c.isdigit() for c in tag), f"{name}: {image} floats"
        assert tag.count(".") >= 2, f"{name}: {image} names no patch release"


def test_infrastructure_services(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert {"nats", "jaeger", "nats-box", *VTM_SERVICES} <= set(s)
    assert s["nats"]["image"].startswith("nats:2")
    cmd = s["nats"]["command"]
    assert "-js" in cmd and cmd[cmd.index("-m") + 1] == "8222"
    assert s["jaeger"]["image"].startswith("cr.jaegertracing.io/jaegertracing/jaeger")
    ports = {p.split(":")[-1] for p in s["jaeger"]["ports"]}
    assert {"4317", "4318", "16686"} <= ports
    # Metrics: Prometheus takes the services' OTLP push itself, at the address they are given.
    assert s["prometheus"]["image"].startswith("prom/prometheus")
    assert "--web.enable-otlp-receiver" in s["prometheus"]["command"]
    assert "9090" in {p.split(":")[-1] for p in s["prometheus"]["ports"]}
    env = s["gateway"]["environment"]
    assert env["VTM_TELEMETRY__METRICS_EXPORTER"] == "otlp"
    assert env["VTM_TELEMETRY__METRICS_ENDPOINT"] == \
        "http://prometheus:9090/api/v1/otlp/v1/metrics"
    assert s["nats-box"]["image"].startswith("natsio/nats-box")
    assert s["nats-box"]["environment"]["NATS_URL"] == "nats://nats:4222"
    # Depends-on targets exist.
    for name, svc in s.items():
        for dep in svc.get("depends_on", {}):
            assert dep in s, f"{name} depends on unknown service {dep}"


def test_one_image_for_every_vertumnus_service(compose: dict[str, Any]) -> None:
    s = compose["services"]
    images = {s[n]["image"] for n in (*VTM_SERVICES, "profile")}
    builds = {json.dumps(s[n]["build"], sort_keys=True) for n in (*VTM_SERVICES, "profile")}
    assert len(images) == 1 and len(builds) == 1
    build = s["gateway"]["build"]
    dockerfile = REPO / build["context"] / build.get("dockerfile", "Dockerfile")
    text = dockerfile.read_text()
    assert "FROM python:3.11-slim" in text
    assert "pip install ." in text
    # What the image copies is what the package needs (pyproject's packages.find).
    for pkg in ("shared", "services", "sim", "vertumnus"):
        assert f"COPY {pkg} " in text


@pytest.mark.parametrize("name", VTM_SERVICES)
def test_service_command_and_settings(compose: dict[str, Any], name: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    svc = compose["services"][name]
    cmd = svc["command"]
    assert cmd[:2] == ["python", "-m"], cmd
    module = cmd[2]
    info = _info_for(module)
    assert info is not None, f"{name}: {module} is not a known service entry point"
    # Every service has landed: one that no longer runs or imports is a failure, not an xfail.
    assert module_runnable(module), f"{name}: `python -m {module}` finds nothing to run"
    cls = info.settings_class()
    assert cls is not None, f"{name}: no settings class found in {info.settings_modules}"
    env = {str(k): str(v) for k, v in svc["environment"].items()}
    known = env_names(cls)
    unknown = sorted(k for k in env if k.startswith("VTM_") and k not in known)
    assert not unknown, f"{name}: not settings of {cls.__name__}: {unknown}"
    # The values parse: build the settings from exactly this environment.
    for key in [k for k in os.environ if k.startswith("VTM_")]:
        monkeypatch.delenv(key)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings = cls()
    assert settings.nats_url == "nats://nats:4222"
    assert settings.telemetry.exporter == "otlp"
    assert settings.telemetry.endpoint == "http://jaeger:4317"


def _settings(compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings service ``name`` builds from exactly its compose environment."""
    info = _info_for(compose["services"][name]["command"][2])
    assert info is not None
    cls = info.settings_class()
    assert cls is not None, name
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("VTM_")]:
            m.delenv(key)
        for k, v in compose["services"][name]["environment"].items():
            m.setenv(str(k), str(v))
        return cls()


def test_the_services_agree_on_the_pool(compose: dict[str, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What every service of the pool must share: its CP degrees and window (scheduler,
    controller, cache manager), its GPUs (controller and rank daemons) and the composition
    before the controller's first record (the rank daemons start the workers the controller
    would write: a mismatch would be reconciled only at the first epoch)."""
    sched = _settings(compose, "scheduler", monkeypatch)
    ctl = _settings(compose, "controller", monkeypatch)
    cache = _settings(compose, "cachemgr", monkeypatch)
    rankd = _settings(compose, "rankd", monkeypatch)
    assert sorted(sched.degrees) == sorted(ctl.degrees) == sorted(cache.degrees)
    assert sched.window_s == ctl.window_s == cache.scan_interval_s
    assert sched.long_threshold_tokens == ctl.long_threshold_tokens  # rules 12 and 15
    assert sched.time_scale == ctl.time_scale == rankd.time_scale  # the modelled clock
    assert rankd.host_range == range(ctl.num_gpus)
    lattice = ctl.lattice()
    initial = Composition.parse(lattice, ctl.initial_composition)
    assert sorted(initial.worker_ids) == sorted(rankd.initial_worker_ids)
    assert len({sched.block_size, ctl.block_size, cache.block_size, rankd.block_size}) == 1


# --- the fitted profile -------------------------------------------------------------------------
def _flag(cmd: list[str], flag: str) -> str:
    assert flag in cmd, f"{flag} missing from {cmd}"
    return cmd[cmd.index(flag) + 1]


def _mounts(compose: dict[str, Any], name: str) -> dict[str, tuple[str, str]]:
    """A service's named-volume mounts: target → (volume, mode); bind mounts are refused."""
    out = {}
    for spec in compose["services"][name].get("volumes", []):
        volume, target, *mode = spec.split(":")
        assert volume in compose.get("volumes", {}), f"{name}: {volume} is not a named volume"
        out[target] = (volume, mode[0] if mode else "rw")
    return out


def _profile_out(compose: dict[str, Any]) -> PurePosixPath:
    return PurePosixPath(_flag(compose["services"]["profile"]["command"], "--out"))


def test_profile_service_fits_the_profile_once_into_a_named_volume(
        compose: dict[str, Any]) -> None:
    svc = compose["services"]["profile"]
    cmd = svc["command"]
    assert cmd[:4] == ["python", "-m", "vertumnus", "profile"], cmd
    assert _flag(cmd, "--backend") == "sim"  # the ground truth the rank daemons sleep for
    assert svc["restart"] == "no"  # one-shot: unless-stopped would run it again and again
    out = _profile_out(compose)
    volume, mode = _mounts(compose, "profile")[str(out)]
    assert mode == "rw"
    # The image creates the mount point owned by its non-root user, so the volume is writable.
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"install -d -o vtm -g vtm {out}" in dockerfile
    assert "USER vtm" in dockerfile
    # Every degree a service of the pool uses is profiled (κ_C of each, Ê_C fitted on each).
    profiled = {int(d) for d in _flag(cmd, "--degrees").split(",")}
    for name in PROFILED:
        env = compose["services"][name]["environment"]
        assert set(json.loads(env["VTM_DEGREES"])) <= profiled, name


@pytest.mark.parametrize("name", VTM_SERVICES)
def test_every_service_that_reads_the_profile_path_loads_the_fitted_profile(
        compose: dict[str, Any], name: str) -> None:
    info = _info_for(compose["services"][name]["command"][2])
    assert info is not None
    cls = info.settings_class()
    assert cls is not None, f"{name}: no settings class found in {info.settings_modules}"
    if "VTM_PROFILE_PATH" not in env_names(cls):
        assert name not in PROFILED, f"{name} no longer reads VTM_PROFILE_PATH"
        return
    assert name in PROFILED
    svc = compose["services"][name]
    out = _profile_out(compose)
    # Started only after `profile` exited 0 (an unfitted start would use the default κ_C) ...
    assert svc["depends_on"]["profile"] == {"condition": "service_completed_successfully"}
    # ... still after the infrastructure (`<<` merges shallowly: restated, not lost).
    assert {"nats", "jaeger", "prometheus"} <= set(svc["depends_on"]), svc["depends_on"]
    # ... reading the file `profile` writes, from the same volume.
    assert PurePosixPath(svc["environment"]["VTM_PROFILE_PATH"]) == out / PROFILE_FILE
    assert _mounts(compose, name)[str(out)] == (_mounts(compose, "profile")[str(out)][0], "ro")


def test_the_profile_command_writes_the_file_the_services_load(
        compose: dict[str, Any], tmp_path: Path) -> None:
    """The compose command as written (only ``--out`` moved here) parses and writes a profile
    with κ_C for every degree of the pool: what the scheduler and controller then load."""
    cmd = list(compose["services"]["profile"]["command"][3:])
    cmd[cmd.index("--out") + 1] = str(tmp_path)
    res = CliRunner().invoke(app, cmd)
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    env = compose["services"]["scheduler"]["environment"]
    profile = Profile.load(tmp_path / PurePosixPath(env["VTM_PROFILE_PATH"]).name)
    assert set(json.loads(env["VTM_DEGREES"])) <= set(profile.kappa)
    assert all(k > 0 for k in profile.kappa.values())
