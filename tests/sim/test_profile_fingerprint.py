"""A profile records the hardware table it was fitted on, not only its names.

``check_profile_hardware`` compared the profile's model and GPU *names* with the run's: a
``--hardware`` file that edits the default H20 table's figures but keeps its names passed, and
the run used a prefill-time model fitted on other figures. A profile of the simulated backend
now records a fingerprint of the whole table (``sim.profiling.hardware_fingerprint``) and a run
compares it; a file without one (written before) keeps the names' check.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shared.costmodel import PROFILE_SCHEMA_VERSION, Profile
from shared.ids import InvalidInput
from sim.groundtruth import GroundTruth
from sim.hardware import ground_truth_from_mapping, load_ground_truth
from sim.profiling import PROFILE_FILE, hardware_fingerprint, run_profile
from sim.runner import PROFILE_MISMATCH_OPTION, check_profile_hardware, load_profile

DEFAULT = GroundTruth()
SLOWER_CP = ground_truth_from_mapping({"calibration": {"d_cp": 0.064}})
"""The default table with one figure changed (the CP fixed cost doubled): same names."""


def test_an_edited_table_with_the_same_names_has_another_fingerprint() -> None:
    assert (SLOWER_CP.model.name, SLOWER_CP.gpu.name) == (DEFAULT.model.name, DEFAULT.gpu.name)
    assert hardware_fingerprint(SLOWER_CP) != hardware_fingerprint(DEFAULT)
    assert hardware_fingerprint(GroundTruth()) == hardware_fingerprint(DEFAULT)


def test_the_fingerprint_ignores_how_a_file_spells_the_table(tmp_path: Path) -> None:
    """Key order and number spelling (96e9 or 96000000000) do not change the table."""
    f = tmp_path / "hw.toml"
    f.write_text('[surroundings]\nswitch_max_s = 1\nfirst_decode_s = 0.03\n\n'
                 '[gpu]\npreset = "H20"\nhbm_bytes = 96000000000\n\n'
                 '[memory_gpu]\nhbm_bytes = 141e9\npreset = "H20-3e"\n')
    truth = load_ground_truth(f)
    assert truth == DEFAULT
    assert hardware_fingerprint(truth) == hardware_fingerprint(DEFAULT)


def test_a_profile_of_the_sim_backend_records_its_table(tmp_path: Path) -> None:
    prof, report = run_profile(tmp_path, degrees=(1, 2), truth=SLOWER_CP, measure_kappas=False)
    assert prof.hardware_fingerprint == hardware_fingerprint(SLOWER_CP)
    data = json.loads((tmp_path / PROFILE_FILE).read_text())
    assert data["hardware_fingerprint"] == hardware_fingerprint(SLOWER_CP)
    assert data["schema_version"] == PROFILE_SCHEMA_VERSION  # an addition: no new version
    assert Profile.load(tmp_path / PROFILE_FILE) == prof


def _fitted_on(truth: GroundTruth) -> Profile:
    return Profile(model=truth.model.name, hardware=truth.gpu.name,
                   hardware_fingerprint=hardware_fingerprint(truth))


def test_a_profile_of_an_edited_table_is_refused_though_the_names_match() -> None:
    with pytest.raises(InvalidInput) as err:
        check_profile_hardware(_fitted_on(DEFAULT), SLOWER_CP, "p.json")
    text = str(err.value)
    assert "--profile p.json was fitted on other hardware" in text
    assert "the same names (model 'Qwen3-30B-A3B', GPU 'H20') but other figures" in text
    assert hardware_fingerprint(DEFAULT) in text and hardware_fingerprint(SLOWER_CP) in text
    assert PROFILE_MISMATCH_OPTION in text
    # ... either way round, a TP profile's too ("<GPU> TP"), and not with the option.
    with pytest.raises(InvalidInput, match="other figures"):
        check_profile_hardware(_fitted_on(SLOWER_CP), DEFAULT, "p.json")
    with pytest.raises(InvalidInput, match="other figures"):
        check_profile_hardware(replace(_fitted_on(DEFAULT), hardware="H20 TP"), SLOWER_CP, "p")
    check_profile_hardware(_fitted_on(DEFAULT), SLOWER_CP, "p.json", mismatch_ok=True)


def test_a_profile_of_the_same_table_passes() -> None:
    check_profile_hardware(_fitted_on(SLOWER_CP), SLOWER_CP, "p.json")
    check_profile_hardware(_fitted_on(DEFAULT), GroundTruth(), "p.json")


def test_a_profile_without_a_fingerprint_keeps_the_names_check(tmp_path: Path) -> None:
    """An older file (no fingerprint): nothing to compare the figures with, so the names
    decide, as before."""
    old = Profile(model=DEFAULT.model.name, hardware=DEFAULT.gpu.name)
    assert "hardware_fingerprint" not in old.to_dict()  # the file it always wrote
    check_profile_hardware(old, SLOWER_CP, "p.json")
    with pytest.raises(InvalidInput, match=r"GPU 'H20' \(the run's: 'H200'\)"):
        check_profile_hardware(old, ground_truth_from_mapping({"gpu": "H200"}), "p.json")
    # A names' mismatch is said as before when both record a fingerprint too.
    h200 = ground_truth_from_mapping({"gpu": "H200"})
    with pytest.raises(InvalidInput, match=r"GPU 'H20' \(the run's: 'H200'\)"):
        check_profile_hardware(_fitted_on(DEFAULT), h200, "p.json")


def test_load_profile_compares_the_file_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    data = _fitted_on(DEFAULT).with_kappa({2: 10.0}).to_dict()
    path.write_text(json.dumps(data))
    load_profile(path, [2], DEFAULT)
    with pytest.raises(InvalidInput, match=f"--profile {path} was fitted on other hardware"):
        load_profile(path, [2], SLOWER_CP)
    del data["hardware_fingerprint"]
    path.write_text(json.dumps(data))
    assert load_profile(path, [2], SLOWER_CP).hardware_fingerprint is None


@pytest.mark.parametrize(("value", "said"), [
    (5, "a number (5)"), ("", "a string of 0 characters"), ("x" * 129,
                                                             "a string of 129 characters"),
    (["ab"], "a list"),
])
def test_a_malformed_fingerprint_is_refused_naming_the_field(tmp_path: Path, value: object,
                                                             said: str) -> None:
    data = {**Profile().to_dict(), "hardware_fingerprint": value}
    with pytest.raises(InvalidInput) as err:
        Profile.from_dict(data, source="profile f.json")
    assert "profile f.json: hardware_fingerprint must be a string of 1 to 128" in str(err.value)
    assert said in str(err.value)
    # null is "none recorded", as an absent key
    assert Profile.from_dict({**data, "hardware_fingerprint": None}).hardware_fingerprint is None
