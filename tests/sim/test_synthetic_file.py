"""The synthetic generator's parameters as a file (sim/workloads/synthetic_file.py): read back
exactly, every bad value named, and the generator's own bounds enforced."""

from __future__ import annotations

import json
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.ids import InvalidInput
from sim.workloads import detect_format, generate, generate_from_file, load_workload
from sim.workloads.synthetic import (
    MAX_POOL,
    MAX_SEGMENTS,
    LogNormalLength,
    Phase,
    SyntheticConfig,
)
from sim.workloads.synthetic_file import (
    FIELD_HELP,
    config_from_mapping,
    config_to_mapping,
    config_to_toml,
    load_synthetic_config,
)


def test_the_template_reads_back_to_the_default_in_toml_and_json() -> None:
    default = SyntheticConfig()
    text = config_to_toml(default)
    assert config_from_mapping(tomllib.loads(text)) == default
    assert config_from_mapping(json.loads(json.dumps(config_to_mapping(default)))) == default
    # Every field has its comment line, right above it.
    lines = text.splitlines()
    for f in fields(SyntheticConfig):
        i = next(k for k, ln in enumerate(lines) if ln.startswith(f"{f.name} = "))
        assert lines[i - 1] == f"# {FIELD_HELP[f.name]}"
    assert set(FIELD_HELP) == {f.name for f in fields(SyntheticConfig)}


def test_a_field_left_out_keeps_the_default_and_a_partial_length_table_its_field() -> None:
    cfg = config_from_mapping({"rate": 3, "system_prompt_len": {"median": 6000}, "phases": []})
    assert cfg.rate == 3.0 and cfg.phases == ()
    assert cfg.system_prompt_len == LogNormalLength(6000.0, 0.5, 512, 8192)
    assert cfg.long_len == SyntheticConfig().long_len
    # A phase without its long share takes the config's.
    cfg = config_from_mapping({"phases": [{"duration_s": 10, "rate_multiplier": 2}]})
    assert cfg.phases == (Phase(10.0, 2.0, None),)


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(0.01, 100.0), long_share=st.floats(0.0, 1.0),
       n_sys=st.integers(0, 50), median=st.floats(1.0, 1e5), sigma=st.floats(0.0, 2.0),
       phases=st.lists(st.tuples(st.floats(1.0, 500.0), st.floats(0.0, 5.0),
                                 st.one_of(st.none(), st.floats(0.0, 1.0))), max_size=4))
def test_any_config_round_trips_through_both_formats(rate, long_share, n_sys, median, sigma,
                                                     phases) -> None:
    cfg = SyntheticConfig(rate=rate, long_share=long_share, n_system_prompts=n_sys,
                          short_len=LogNormalLength(median, sigma, 1, 30_000),
                          phases=tuple(Phase(*p) for p in phases))
    assert config_from_mapping(tomllib.loads(config_to_toml(cfg))) == cfg
    assert config_from_mapping(json.loads(json.dumps(config_to_mapping(cfg)))) == cfg


@pytest.mark.parametrize(("data", "message"), [
    ([1, 2], "must be a table of the generator's fields"),
    ({"rat": 1}, "unknown field(s) 'rat'; known: duration_s, rate,"),
    ({"rate": "fast"}, "rate: must be a number, got 'fast'"),
    ({"rate": True}, "rate: must be a number, got True"),
    ({"rate": 0}, "rate must be > 0 req/s"),
    ({"rate": float("nan")}, "rate: must be finite"),
    ({"n_system_prompts": 2.5}, "n_system_prompts: must be an integer, got 2.5"),
    ({"n_system_prompts": MAX_POOL + 1}, "n_system_prompts and long_doc_pool must be in"),
    ({"long_share": 1.5}, "long_share must be in [0, 1]"),
    ({"mean_turns": 1}, "mean_turns must be finite and >= 2"),
    ({"system_prompt_zipf": -1}, "zipf must be finite and >= 0"),
    ({"max_input_len": 2**25}, "max_input_len must be in [1, 16,777,216]"),
    ({"duration_s": 1e9, "rate": 1e-5}, "duration_s must be at most"),
    ({"rate": 1e6}, "at most 1,000,000 requests are allowed"),
    ({"phases": [{"duration_s": 10, "rate_multiplier": 1e7}]}, "makes about"),
    ({"short_len": 1500}, "short_len: must be a table of median, sigma, lo, hi"),
    ({"short_len": {"mean": 3}}, "short_len: unknown field(s) 'mean'"),
    ({"short_len": {"median": -1}}, "short_len: bad length distribution"),
    ({"short_len": {"sigma": 1e6}}, "0 <= sigma <= 10"),
    ({"short_len": {"lo": 10, "hi": 5}}, "0 <= lo <= hi"),
    ({"short_len": {"hi": 1.5}}, "short_len.hi: must be an integer"),
    ({"phases": 3}, "phases: must be a list of tables"),
    ({"phases": [3]}, "phases[0]: must be a table of duration_s, rate_multiplier"),
    ({"phases": [{"rate_multiplier": 1}]}, "phases[0]: missing field(s) duration_s"),
    ({"phases": [{"duration_s": 5, "rate_multiplier": 1, "x": 0}]}, "phases[0]: unknown"),
    ({"phases": [{"duration_s": -5, "rate_multiplier": 1}]}, "phases[0]: phase duration"),
    ({"phases": [{"duration_s": 1e-3, "rate_multiplier": 1}]},
     f"more than {MAX_SEGMENTS:,} segments"),
])
def test_every_bad_value_is_named(data, message) -> None:
    with pytest.raises(InvalidInput) as exc:
        config_from_mapping(data, source="w.toml")
    assert str(exc.value).startswith("w.toml: ")
    assert message in str(exc.value)
    assert "SyntheticConfig:" not in str(exc.value)


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="synthetic workload file not found"):
        load_synthetic_config(tmp_path / "none.toml")
    yaml = tmp_path / "w.yaml"
    yaml.write_text("rate: 3\n")
    with pytest.raises(InvalidInput, match=r"w\.yaml: a synthetic workload file is \.json or "
                                           r"\.toml; this one has the suffix '\.yaml'"):
        load_synthetic_config(yaml)
    broken = tmp_path / "w.toml"
    broken.write_text("rate = \n")
    with pytest.raises(InvalidInput, match=r"w\.toml: not valid TOML"):
        load_synthetic_config(broken)
    bad = tmp_path / "bad.toml"
    bad.write_text("rate = -2\n")
    with pytest.raises(InvalidInput, match=r"bad\.toml: rate must be > 0"):
        load_synthetic_config(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"rate = 2\n\xff\n")
    with pytest.raises(InvalidInput, match=r"bin\.toml:2: not valid UTF-8"):
        load_synthetic_config(binary)


def test_a_toml_file_is_a_workload_named_after_it(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('rate = 4.0\nphases = []\nlong_share = 0.0\nduration_s = 60.0\n'
                 'n_system_prompts = 3\nsystem_prompt_len = { median = 6000, sigma = 0.1 }\n')
    assert detect_format(f) == "synthetic"
    wl = load_workload(f, seed=2)
    cfg = load_synthetic_config(f)
    again = generate(cfg, seed=2, name="agent")
    assert wl.name == "agent"
    assert [(r.arrival_s, r.input_len, r.block_hashes) for r in wl] == [
        (r.arrival_s, r.input_len, r.block_hashes) for r in again]
    assert all(r.input_len < 32_768 for r in wl)  # long_share 0
    assert wl.metadata["config"]["rate"] == 4.0
    # A rate replaces the file's base rate, and is checked like the file's.
    assert load_workload(f, seed=2, rate=8.0).metadata["config"]["rate"] == 8.0
    with pytest.raises(InvalidInput, match="agent.toml at rate 1e"):
        generate_from_file(f, rate=1e9)
