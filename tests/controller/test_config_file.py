"""The controller's thresholds as a file (services/controller/config_file.py): what reads back,
what is refused and how the refusal names the file and the key."""

from __future__ import annotations

import json
import tomllib
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.calibration import CONTROLLER
from services.controller.config_file import (
    FIELD_KINDS,
    NONE_MEANS,
    config_from_mapping,
    config_to_mapping,
    config_to_toml,
    load_controller_config,
)
from services.controller.planner import ControllerConfig
from shared.ids import InvalidInput

OPTIONAL = [name for name, (_, optional) in FIELD_KINDS.items() if optional]


def test_every_field_has_a_kind_and_every_optional_one_says_what_false_means() -> None:
    assert list(FIELD_KINDS) == [f.name for f in fields(ControllerConfig)]
    assert set(NONE_MEANS) == set(OPTIONAL)
    assert FIELD_KINDS["persistence"] == ("int", False)
    assert FIELD_KINDS["momentum"] == ("bool", False)
    assert FIELD_KINDS["merge_speedup"] == ("float", True)


def test_an_empty_file_is_the_calibrated_setting() -> None:
    assert config_from_mapping({}) == CONTROLLER


def test_a_field_replaces_the_calibrated_value_and_false_or_null_turns_a_rule_off() -> None:
    cfg = config_from_mapping({"upper": 0.8, "split_target": 0.7, "preference_headroom": 0.8,
                               "large_floor": False, "backlog_s": None, "persistence": 3.0})
    assert (cfg.upper, cfg.split_target, cfg.preference_headroom) == (0.8, 0.7, 0.8)
    assert cfg.large_floor is None and cfg.backlog_s is None
    assert cfg.persistence == 3 and isinstance(cfg.persistence, int)  # 3.0 is an integer
    assert cfg.merge_speedup == CONTROLLER.merge_speedup  # left out: calibrated


@pytest.mark.parametrize("config", [
    CONTROLLER,
    ControllerConfig(),  # the planner's own defaults: every optional rule off
    replace(CONTROLLER, momentum=True, newest_first=False, max_ops=1, window_s=7.5),
])
def test_toml_and_json_read_back(config: ControllerConfig) -> None:
    text = config_to_toml(config, {"upper": "Split when D > upper·capacity."})
    assert config_from_mapping(tomllib.loads(text)) == config
    assert "# Split when D > upper·capacity.\nupper = " in text
    assert config_from_mapping(json.loads(json.dumps(config_to_mapping(config)))) == config


def test_the_template_says_what_false_means_for_each_optional_field() -> None:
    text = config_to_toml(CONTROLLER)
    for name in OPTIONAL:
        assert f"(false: {NONE_MEANS[name]})\n{name} = " in text
    assert max(len(line) for line in text.splitlines()) <= 100


_VALUES = {
    "float": st.floats(0.01, 50.0),
    "int": st.integers(1, 200),
    "bool": st.booleans(),
}


@settings(max_examples=60, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_any_valid_setting_reads_back_from_either_format(data: st.DataObject) -> None:
    names = data.draw(st.lists(st.sampled_from(list(FIELD_KINDS)), unique=True, max_size=8))
    values = {}
    for name in names:
        kind, optional = FIELD_KINDS[name]
        strat = _VALUES[kind]
        values[name] = data.draw(st.none() | strat if optional else strat)
    try:
        config = replace(CONTROLLER, **values)
    except InvalidInput:
        assume(False)
        return
    assert config_from_mapping(tomllib.loads(config_to_toml(config))) == config
    assert config_from_mapping(json.loads(json.dumps(config_to_mapping(config)))) == config


@pytest.mark.parametrize(("data", "words"), [
    ({"uper": 1.0}, "unknown key 'uper'; the keys are window_s, "),
    ({"upper": "1"}, "upper: must be a number, got '1'"),
    ({"upper": True}, "upper: must be a number, got True"),
    ({"upper": False}, "upper: must be a number, got False"),  # not optional: false is no value
    ({"upper": float("nan")}, "upper: must be finite"),
    ({"persistence": 1.5}, "persistence: must be an integer, got 1.5"),
    ({"merge_memory": 2.5}, "merge_memory: must be an integer (or false), got 2.5"),
    ({"large_floor": True}, "large_floor: must be an integer (or false), got True"),
    ({"merge_speedup": [1.2]}, "merge_speedup: must be a number (or false), got [1.2]"),
    ({"momentum": 1}, "momentum: must be true or false, got 1"),
    ({"newest_first": None}, "newest_first: must be true or false, got None"),
    ({"upper": 0.4}, "ControllerConfig needs 0 < lower < upper, got lower=0.5, upper=0.4"),
    ({"upper": 0.8, "split_target": 0.8},
     "preference_headroom must be None or in (0, upper=0.8], got 0.9 (preference_headroom is "
     "not in the file and keeps 0.9; set it there too)"),
    ({"upper": 0.8, "split_target": 0.9, "preference_headroom": 0.8},
     "split_target must be in (0, upper=0.8], got 0.9"),
    ({"persistence": 0}, "persistence must be an integer >= 1, got 0"),
    ({"merge_speedup": 0.9}, "merge_speedup must be None or >= 1, got 0.9"),
    ({"window_s": -20}, "window_s must be >= 0.01 s"),
])
def test_a_bad_value_is_refused_naming_the_source_and_the_key(data: dict, words: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        config_from_mapping(data, source="mine.toml")
    assert str(exc.value).startswith("mine.toml: ")
    assert words in str(exc.value)


@pytest.mark.parametrize("data", [[1, 2], "upper = 1", 3])
def test_a_file_that_is_not_a_table_is_refused(data: object) -> None:
    with pytest.raises(InvalidInput, match="mine.json: must be a table of controller fields"):
        config_from_mapping(data, source="mine.json")


def test_load_reads_toml_and_json_and_names_a_bad_file(tmp_path: Path) -> None:
    toml_file = tmp_path / "c.toml"
    toml_file.write_text("upper = 0.9\nsplit_target = 0.9\nlarge_floor = false\n")
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps({"upper": 0.9, "split_target": 0.9, "large_floor": None}))
    want = replace(CONTROLLER, upper=0.9, split_target=0.9, large_floor=None)
    assert load_controller_config(toml_file) == load_controller_config(json_file) == want
    cases = [
        (tmp_path / "missing.toml", "controller file not found"),
        (tmp_path, "is a directory"),
        (tmp_path / "c.yaml", "a controller file is .json or .toml"),
        (tmp_path / "broken.toml", "not valid TOML"),
        (tmp_path / "key.toml", "key.toml: upper: must be a number"),
    ]
    (tmp_path / "c.yaml").write_text("upper: 1\n")
    (tmp_path / "broken.toml").write_text("upper = \n")
    (tmp_path / "key.toml").write_text('upper = "high"\n')
    for path, words in cases:
        with pytest.raises(InvalidInput, match=None) as exc:
            load_controller_config(path)
        assert words in str(exc.value), str(exc.value)


def test_the_shipped_controller_files_read() -> None:
    """docs/controllers/*.toml are files the README and docs/evaluation.md run."""
    root = Path(__file__).resolve().parents[2] / "docs" / "controllers"
    files = sorted(root.glob("*.toml"))
    assert files
    for f in files:
        assert load_controller_config(f) != CONTROLLER
    agent = load_controller_config(root / "tool-agent.toml")
    assert agent == replace(CONTROLLER, merge_speedup=None, upper=0.8, split_target=0.8,
                            preference_headroom=0.8)
