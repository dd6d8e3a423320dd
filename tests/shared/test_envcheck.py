"""shared/envcheck.py: a ``VTM_*`` variable that no vertumnus process reads (a misspelt name,
which pydantic-settings would ignore) ends a service at its start with exit status 2, naming
it and the known name closest to it; a variable another vertumnus process reads is no error
(one environment serves several services: docker-compose's shared anchor, one ``.env``).

The torch backend's variables (``VTM_TORCH_*``) are known by their exact names too, though
the control-plane image has no torch: their settings class lives in a module that imports none
(services/rankd/torch_settings.py).

Also: the lists of who reads what (envcheck's module constants) are checked against the code,
so that they cannot fall behind it -- every settings class of the tree, every ``"VTM_..."``
literal, every variable docker-compose.yml and the Dockerfile set."""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from services.cachemgr.service import CacheMgrSettings
from services.controller.service import ControllerSettings
from services.gateway.settings import GatewaySettings
from services.rankd.settings import RankdSettings
from services.rankd.torch_backend import TorchSettings
from services.scheduler.service import SchedulerSettings
from shared import envcheck
from shared.envcheck import (
    ENV_PREFIX,
    SETTINGS_CLASSES,
    all_readers,
    readers_of,
    unknown_variables,
)
from shared.servicemain import check_environment, load_settings
from shared.settings import ServiceSettings, env_names
from vertumnus.live.rankd_sim import SimRankdSettings

REPO = Path(__file__).resolve().parents[2]
NOWHERE = {"VTM_NATS_URL": "nats://127.0.0.1:9"}  # never reached: the check comes first
CODE_DIRS = ("services", "shared", "vertumnus", "sim")
CLASSES = (GatewaySettings, SchedulerSettings, ControllerSettings, CacheMgrSettings,
           RankdSettings, SimRankdSettings, TorchSettings)
TYPO = "VTM_WINDOWS_S: no vertumnus service reads it (did you mean VTM_WINDOW_S?)"
TORCH_TYPO = ("VTM_TORCH_MODEL_PATHH: no vertumnus service reads it "
              "(did you mean VTM_TORCH_MODEL_PATH?)")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No ``VTM_*`` variable of the test run's own environment in the way."""
    for k in list(os.environ):
        if k.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(k)
    yield monkeypatch


# -- unknown_variables ---------------------------------------------------------------------------


def test_a_misspelt_top_level_variable_is_named_with_the_closest_known_name() -> None:
    assert unknown_variables({"VTM_WINDOWS_S": "5"}, ControllerSettings) == [TYPO]
    assert unknown_variables({"VTM_BLOKC_SIZE": "256"}, GatewaySettings) == [
        "VTM_BLOKC_SIZE: no vertumnus service reads it (did you mean VTM_BLOCK_SIZE?)"]


def test_a_name_close_to_nothing_gets_no_suggestion() -> None:
    assert unknown_variables({"VTM_ZQXJ": "1"}, GatewaySettings) == [
        "VTM_ZQXJ: no vertumnus service reads it"]


def test_every_unknown_variable_is_named_once_sorted() -> None:
    env = {"VTM_WINDOWS_S": "5", "VTM_BLOKC_SIZE": "1", "VTM_WINDOW_S": "5"}
    lines = unknown_variables(env, ControllerSettings)
    assert [line.split(":")[0] for line in lines] == ["VTM_BLOKC_SIZE", "VTM_WINDOWS_S"]


def test_a_variable_another_service_reads_is_no_error() -> None:
    others = {"VTM_DEGREES": "[2, 4]", "VTM_WINDOW_S": "20", "VTM_TRUTH": "exact",
              "VTM_HOST_GPUS": "0-7", "VTM_POLICY": "vertumnus", "VTM_NUM_GPUS": "8"}
    assert not set(others) & env_names(GatewaySettings)  # they are the others' indeed
    assert unknown_variables(others, GatewaySettings) == []
    # The gateway's own, for the controller.
    gw = {"VTM_HTTP_PORT": "8080", "VTM_FORWARD_TOKENS": "false", "VTM_API_KEYS": "k"}
    assert unknown_variables(gw, ControllerSettings) == []


def test_names_read_outside_settings_classes_and_the_torch_settings_are_known() -> None:
    env = {"VTM_NATS_SERVER_BIN": "/x", "VTM_GATEWAY_CA": "/ca.pem", "VTM_API_KEY": "k",
           "VTM_TORCH_DEVICE": "cuda", "VTM_TORCH_VARLEN": "1", "VTM_TORCH_DTYPE": "bfloat16"}
    env |= {name: "1" for name in env_names(TorchSettings)}
    assert len(env) > 15
    for cls in CLASSES:
        assert unknown_variables(env, cls) == [], cls


def test_a_misspelt_torch_variable_is_named_with_the_closest_known_name() -> None:
    """The torch backend's names are exact: no ``VTM_TORCH_`` family known as a whole."""
    for cls in CLASSES:
        assert unknown_variables({"VTM_TORCH_MODEL_PATHH": "/ckpt"}, cls) == [TORCH_TYPO], cls
    assert unknown_variables({"VTM_TORCH_VARLENN": "1"}, RankdSettings) == [
        "VTM_TORCH_VARLENN: no vertumnus service reads it (did you mean VTM_TORCH_VARLEN?)"]
    every = all_readers()
    assert every is not None
    assert not [p for p in every.prefixes if p.startswith("VTM_TORCH")], every.prefixes


def test_rankd_and_profile_read_the_listed_torch_settings_class() -> None:
    """rankd and ``vertumnus profile --backend torch`` read the class envcheck lists (one
    class, re-exported by the torch backend), from a module that imports no torch."""
    from services.rankd import torch_settings
    from services.rankd.engine import profiling

    assert TorchSettings is torch_settings.TorchSettings
    assert "services.rankd.torch_settings:TorchSettings" in SETTINGS_CLASSES
    assert profiling.TINY_MODEL is torch_settings.TINY_MODEL
    assert TorchSettings().model_dict() == torch_settings.TINY_MODEL


def test_a_dict_setting_is_read_key_by_key_too(clean_env: pytest.MonkeyPatch) -> None:
    # pydantic-settings fills a dict field from VTM_FIELD__KEY as well: no typo.
    clean_env.setenv("VTM_POLICY_PARAMS__HALF_LIFE_S", "3")
    assert SchedulerSettings().policy_params == {"half_life_s": "3"}
    for cls in CLASSES:
        assert unknown_variables({"VTM_POLICY_PARAMS__HALF_LIFE_S": "3"}, cls) == [], cls


def test_variables_without_the_prefix_are_ignored() -> None:
    env = {"PATH": "/bin", "VTMX": "1", "XVTM_WINDOWS_S": "1", "NATS_URL": "nats://x",
           "VTM": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}
    assert unknown_variables(env, ControllerSettings) == []


def test_names_match_in_any_case_as_pydantic_settings_reads_them(
        clean_env: pytest.MonkeyPatch) -> None:
    # pydantic-settings matches names case-insensitively (case_sensitive is off in every
    # class), so a lower-case name is read, and a misspelt one is as much a typo.
    assert all(not cls.model_config.get("case_sensitive", False) for cls in CLASSES)
    clean_env.setenv("vtm_window_s", "7")
    assert ControllerSettings().window_s == 7
    assert unknown_variables({"vtm_window_s": "7"}, ControllerSettings) == []
    assert unknown_variables({"Vtm_Windows_S": "7"}, ControllerSettings) == [
        "Vtm_Windows_S: no vertumnus service reads it (did you mean VTM_WINDOW_S?)"]


def test_a_misspelt_field_of_a_nested_group_is_still_pydantics_to_reject(
        clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("VTM_TELEMETRY__EXPORTR", "otlp")
    with pytest.raises(ValidationError):
        ControllerSettings()
    with pytest.raises(SystemExit) as exc:
        load_settings(ControllerSettings, "ctl")
    assert exc.value.code == 2
    assert "  VTM_TELEMETRY__EXPORTR: Extra inputs are not permitted" in capsys.readouterr().err


def test_an_unimportable_list_makes_no_variable_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A module of the lists that cannot be imported (an installation without it, a missing
    dependency) may be the one that reads the variable: nothing is called unknown then."""
    monkeypatch.setattr(envcheck, "SETTINGS_CLASSES",
                        (*SETTINGS_CLASSES, "vertumnus_no_such_module:Settings"))
    all_readers.cache_clear()
    try:
        assert all_readers() is None
        assert unknown_variables({"VTM_WINDOWS_S": "5"}, ControllerSettings) == []
    finally:
        monkeypatch.undo()
        all_readers.cache_clear()
    assert unknown_variables({"VTM_WINDOWS_S": "5"}, ControllerSettings) == [TYPO]


def test_the_lists_import_without_torch() -> None:
    """The control-plane image has no torch: every module of the lists must import without
    it (else its variables would go unjudged there), and the check imports no torch."""
    code = ("import sys\n"
            "sys.modules['torch'] = None  # `import torch` raises ImportError\n"
            "from shared.envcheck import all_readers, unknown_variables\n"
            "from services.gateway.settings import GatewaySettings\n"
            "assert all_readers() is not None\n"
            "assert unknown_variables({'VTM_TRUTH': 'exact'}, GatewaySettings) == []\n"
            "assert unknown_variables({'VTM_WINDOWS_S': '5'}, GatewaySettings)\n"
            "assert unknown_variables({'VTM_TORCH_MODEL_PATH': '/c', 'VTM_TORCH_VARLEN': '1'},"
            " GatewaySettings) == []\n"
            f"assert unknown_variables({{'VTM_TORCH_MODEL_PATHH': '/c'}}, GatewaySettings)"
            f" == [{TORCH_TYPO!r}]\n"
            "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_usual_start_imports_no_other_service() -> None:
    """A process whose own class reads every VTM_* variable it is given imports nothing
    more (the other services' settings are imported only to judge a leftover)."""
    code = ("import sys\n"
            "from shared.envcheck import unknown_variables\n"
            "from services.gateway.settings import GatewaySettings\n"
            "assert unknown_variables({'VTM_BLOCK_SIZE': '16', 'PATH': '/'},"
            " GatewaySettings) == []\n"
            "print(sorted(m for m in sys.modules if m.startswith(('services.controller',"
            " 'services.scheduler', 'services.cachemgr', 'services.rankd', 'vertumnus'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# -- the service mains ---------------------------------------------------------------------------


def test_load_settings_exits_2_naming_the_variable(
        clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("VTM_WINDOWS_S", "5")
    with pytest.raises(SystemExit) as exc:
        load_settings(ControllerSettings, "ctl")
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"ctl: invalid settings:\n  {TYPO}\n"


def test_check_environment_passes_another_services_variables(
        clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VTM_DEGREES", "[2, 4]")
    clean_env.setenv("VTM_TRUTH", "exact")
    from services.gateway.main import parse_settings

    assert parse_settings([]).block_size == GatewaySettings().block_size
    check_environment(GatewaySettings, "gw")  # returns


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A listening TCP socket that never answers, as the NATS server of a process that must
    not connect: a connection attempt completes in the kernel's backlog without an accept, so
    once the process has ended a non-blocking accept tells whether it ever tried."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.setblocking(False)
        yield sock


def _was_contacted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("module", ["services.controller", "services.gateway"])
def test_a_service_with_a_misspelt_variable_exits_2_before_connecting(
        module: str, silent_server: socket.socket) -> None:
    """Exit 2 with the settings message and nothing else on stderr (each connect attempt
    would log a "nats error" line), and the NATS server it was given never reached. A
    process that connected first would wait for that server's INFO: the subprocess timeout
    only ends such a hang, it proves nothing."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    url = f"nats://127.0.0.1:{silent_server.getsockname()[1]}"
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, capture_output=True,
                          text=True, timeout=90,
                          env={**env, "VTM_NATS_URL": url, "VTM_WINDOWS_S": "5"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"python -m {module}: invalid settings:",
                                        f"  {TYPO}"], proc.stderr
    assert not _was_contacted(silent_server), "it connected to its NATS server first"


def test_a_torch_rankd_with_a_misspelt_torch_variable_exits_2_before_connecting() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(ENV_PREFIX)}
    env |= {**NOWHERE, "VTM_BACKEND": "torch", "VTM_TORCH_MODEL_PATHH": "/ckpt"}
    proc = subprocess.run([sys.executable, "-m", "services.rankd.main"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"  {TORCH_TYPO}", proc.stderr


def test_vertumnus_up_refuses_a_misspelt_variable_before_starting(
        clean_env: pytest.MonkeyPatch) -> None:
    """Every child inherits up's environment and would refuse the variable: up names it
    first (exit 2), and passes another service's variable on as before."""
    from vertumnus.live.stack import UpConfig

    clean_env.setenv("VTM_WINDOWS_S", "5")
    with pytest.raises(ValueError, match=re.escape(TYPO)):
        UpConfig(gpus=4)
    clean_env.delenv("VTM_WINDOWS_S")
    clean_env.setenv("VTM_TRUTH", "exact")
    UpConfig(gpus=4)

    from typer.testing import CliRunner

    from vertumnus.cli import app

    res = CliRunner().invoke(app, ["up", "--duration", "5"], env={"VTM_WINDOWS_S": "5"})
    assert res.exit_code == 2, res.output
    assert TYPO in res.output


# -- the lists against the code ------------------------------------------------------------------


def _py_files() -> Iterator[tuple[str, ast.Module]]:
    for d in CODE_DIRS:
        for p in sorted((REPO / d).rglob("*.py")):
            rel = p.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), ast.parse(p.read_text(), filename=str(p))


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_every_settings_class_of_the_tree_is_listed() -> None:
    """Every pydantic-settings class in services/, shared/, vertumnus/, sim/ (found in the
    source: a class deriving, through any of them, from BaseSettings) is listed."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for mod, tree in _py_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (mod, node)
    settings = {"BaseSettings"}
    grew = True
    while grew:
        grew = False
        for name, (_, node) in classes.items():
            if name not in settings and any(_base_name(b) in settings for b in node.bases):
                settings.add(name)
                grew = True
    found = {name: classes[name] for name in settings if name in classes}
    assert {"ServiceSettings", "GatewaySettings", "TorchSettings"} <= set(found)  # it finds
    for name, (mod, _) in sorted(found.items()):
        if name == "ServiceSettings":
            continue  # the base of every listed class
        assert f"{mod}:{name}" in SETTINGS_CLASSES, \
            f"{mod}:{name} is missing from shared.envcheck.SETTINGS_CLASSES"


def test_every_listed_class_exists_and_every_registry_service_is_listed() -> None:
    from vertumnus.live.registry import SERVICES, SIM_RANKD

    listed = {f"{cls.__module__}:{cls.__name__}" for cls in CLASSES}
    assert listed == set(SETTINGS_CLASSES)
    for info in (*SERVICES.values(), SIM_RANKD):
        cls = info.settings_class()
        assert cls is not None and f"{cls.__module__}:{cls.__name__}" in SETTINGS_CLASSES, info


def test_every_vtm_literal_of_the_code_is_known() -> None:
    """A ``"VTM_..."`` string literal in the code is a variable read by name (or set for a
    child): each is known to envcheck. A literal ending in ``_`` is a prefix: ``VTM_`` itself,
    a listed class's env_prefix (``f"VTM_TORCH_{name}"``) or a dict setting's keys."""
    every = all_readers()
    assert every is not None
    prefixes = {ENV_PREFIX, *every.prefixes,
                *(str(cls.model_config.get("env_prefix", "")) for cls in CLASSES)}
    seen = 0
    for mod, tree in _py_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"VTM_[A-Z0-9_]*", node.value):
                seen += 1
                name = node.value
                if name.endswith("_"):
                    assert name in prefixes, f"{mod}: {name}"
                else:
                    assert every.reads(name), f"{mod}: {name} is unknown to shared.envcheck"
    assert seen > 50  # (else this checks nothing)


def test_every_variable_compose_and_the_dockerfile_set_is_known_to_every_service() -> None:
    """docker-compose gives each service the shared anchor and its own variables; the image
    sets VTM_LOG__FORMAT for all: none of them may stop any service."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    env: dict[str, str] = {}
    for svc in compose["services"].values():
        env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()
                    if k.startswith(ENV_PREFIX)})
    docker = (REPO / "Dockerfile").read_text()
    env.update(dict(re.findall(r"\b(VTM_[A-Z0-9_]+)=(\S+)", docker)))
    assert len(env) > 20 and "VTM_LOG__FORMAT" in env
    for cls in CLASSES:
        assert unknown_variables(env, cls) == [], cls


def test_readers_of_a_class_are_its_env_names() -> None:
    r = readers_of(ServiceSettings)
    assert r.names == env_names(ServiceSettings)
    assert "VTM_TELEMETRY__EXPORTER" in r.names and r.prefixes == ()
    assert "VTM_POLICY_PARAMS__" in readers_of(SchedulerSettings).prefixes
