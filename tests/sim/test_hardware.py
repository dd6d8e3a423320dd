"""The simulated hardware as a file (``sim/hardware.py``): what a file may say, what it gets
back for what it leaves out, and a clear error naming the key for everything else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.ids import InvalidInput
from sim.groundtruth import H20, H20_3E, H200, GroundTruth
from sim.hardware import ground_truth_from_mapping, ground_truth_to_mapping, load_ground_truth
from sim.profiling import PROFILE_P, PROFILE_R, run_profile, score_against_truth


def test_the_default_hardware_round_trips_through_a_mapping() -> None:
    m = ground_truth_to_mapping(GroundTruth())
    assert json.loads(json.dumps(m)) == m  # JSON as it is (meta.json)
    assert ground_truth_from_mapping(m) == GroundTruth()
    assert ground_truth_from_mapping({}) == GroundTruth()


def test_toml_and_json_files_say_the_same(tmp_path: Path) -> None:
    toml = tmp_path / "hw.toml"
    toml.write_text('gpu = "H200"\n\n[model]\nname = "mine"\nlayers = 64\n\n'
                    '[calibration.eta_moe]\neta_max = 0.7\nx_half = 2048\n')
    js = tmp_path / "hw.json"
    js.write_text(json.dumps({"gpu": "H200", "model": {"name": "mine", "layers": 64},
                              "calibration": {"eta_moe": {"eta_max": 0.7, "x_half": 2048}}}))
    a, b = load_ground_truth(toml), load_ground_truth(js)
    assert a == b
    assert a.model.layers == 64 and a.model.name == "mine"
    assert a.model.hidden == GroundTruth().model.hidden  # left out: the default
    assert a.calibration.eta_moe.eta_max == 0.7 and a.calibration.eta_moe.x_half == 2048.0
    assert a.calibration.d_cp == GroundTruth().calibration.d_cp


def test_gpu_presets_and_which_gpu_sets_the_memory() -> None:
    d = GroundTruth()
    assert (d.gpu, d.memory_gpu) == (H20, H20_3E)  # the note's pair, while neither is given
    only = ground_truth_from_mapping({"gpu": "H200"})
    assert (only.gpu, only.memory_gpu) == (H200, H200)
    both = ground_truth_from_mapping({"gpu": "H200", "memory_gpu": "H20"})
    assert (both.gpu, both.memory_gpu) == (H200, H20)
    small = ground_truth_from_mapping({"gpu": {"preset": "H200", "hbm_bytes": 80e9,
                                               "name": "H200-80G"}})
    assert small.gpu.peak_flops == H200.peak_flops and small.gpu.hbm_bytes == 80e9
    assert small.kv_capacity_blocks(1) < only.kv_capacity_blocks(1)
    own = ground_truth_from_mapping({"gpu": {"name": "X", "peak_flops": 500e12,
                                             "hbm_bytes": 192e9, "hbm_bandwidth": 8e12}})
    assert own.gpu.bandwidth_efficiency == H20.bandwidth_efficiency  # its default


def test_a_faster_gpu_prefills_faster_and_caches_what_its_memory_holds() -> None:
    fast = ground_truth_from_mapping({"gpu": "H200"})
    d = GroundTruth()
    for r in PROFILE_R:
        for c in (1, 2, 4):
            assert fast.prefill_time(r, 0, c) < d.prefill_time(r, 0, c), (r, c)
    assert fast.kv_capacity_blocks(2) == d.kv_capacity_blocks(2)  # H200 and H20-3e: 141 GB


def test_a_profile_fitted_on_a_hardware_file_describes_that_hardware() -> None:
    """The sweep fits its profile on the file's hardware (never hands the ground truth to
    the scheduler): that profile predicts it better than one fitted on the default."""
    fast = ground_truth_from_mapping({"gpu": "H200"})
    grid = [(r, p, c) for r in PROFILE_R for p in PROFILE_P for c in (1, 2) if p < r]
    own, _ = run_profile_quiet(fast)
    default, _ = run_profile_quiet(GroundTruth())
    assert score_against_truth(own, grid, fast)["mape"] \
        < score_against_truth(default, grid, fast)["mape"] / 2


def test_a_coefficient_set_per_degree_follows_hardware_one_set_cannot() -> None:
    """On H200 the CP fixed cost dominates short prompts at C > 1 and is absent at C = 1: one
    global set misses short prompts by a third; one set per degree fits them."""
    fast = ground_truth_from_mapping({"gpu": "H200"})
    grid = [(r, p, c) for r in PROFILE_R for p in PROFILE_P for c in (1, 2) if p < r]
    one, _ = run_profile_quiet(fast)
    per, _ = run_profile_quiet(fast, per_degree=True)
    assert not one.per_degree and set(per.per_degree) == {1, 2}
    assert score_against_truth(per, grid, fast)["mape"] \
        < score_against_truth(one, grid, fast)["mape"] / 3
    short = fast.prefill_time(1024, 0, 2)
    assert abs(per.predict(1024, 0, 2) / short - 1) < 0.1 < abs(one.predict(1024, 0, 2) / short - 1)


def run_profile_quiet(truth: GroundTruth, *, per_degree: bool = False) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return run_profile(d, degrees=(1, 2), seed=0, truth=truth, measure_kappas=False,
                           per_degree=per_degree)


@pytest.mark.parametrize(("data", "words"), [
    ([1, 2], "must be a table"),
    ({"gpus": "H200"}, "unknown key(s) 'gpus'"),
    ({"gpu": "H100"}, "unknown GPU preset 'H100'"),
    ({"gpu": {"peak_flops": 1e15}}, "gpu: missing field(s) name, hbm_bytes, hbm_bandwidth"),
    ({"gpu": {"preset": "B200"}}, "gpu.preset: unknown GPU preset 'B200'"),
    ({"memory_gpu": {"preset": "H20", "hbm_bytes": -1}}, "memory_gpu.hbm_bytes: must be > 0"),
    ({"model": {"layerz": 3}}, "model: unknown field(s) 'layerz'"),
    ({"model": {"layers": "many"}}, "model.layers: must be a number"),
    ({"model": {"layers": 2.5}}, "model.layers: must be an integer"),
    ({"model": {"layers": True}}, "model.layers: must be a number"),
    ({"model": {"name": ""}}, "model.name: must be a non-empty string"),
    ({"model": {"top_k": 200}}, "top_k 200 exceeds experts 128"),
    ({"model": {"kv_heads": 64}}, "model.kv_heads: 64 KV heads exceed the 32 query heads"),
    ({"model": {"q_heads": 8, "kv_heads": 16}}, "model.kv_heads: 16 KV heads exceed the 8"),
    ({"model": {"q_heads": 30, "kv_heads": 4}},
     "model.q_heads: 30 query heads are not a multiple of the 4 KV heads"),
    ({"model": {"weight_bytes": 1e12}}, "not a usable ground truth"),
    ({"calibration": {"beta_ag": 0}}, "calibration.beta_ag: must be > 0"),
    ({"calibration": {"d_cp": -0.1}}, "calibration.d_cp: must be >= 0"),
    ({"calibration": {"sigma": float("nan")}}, "calibration.sigma: must be finite"),
    ({"calibration": {"eta_attn": {"eta_max": 1.5, "x_half": 1}}},
     "calibration.eta_attn.eta_max: an efficiency is at most 1"),
    ({"calibration": {"eta_attn": 0.8}}, "calibration.eta_attn: must be a table"),
    ({"surroundings": {"switch_min_s": 2.0}}, "switch_min_s <= switch_max_s"),
    ({"surroundings": {"kv_capacity_blocks_per_gpu": 0}},
     "surroundings.kv_capacity_blocks_per_gpu: must be > 0"),
])
def test_bad_hardware_is_an_error_naming_the_key(data: Any, words: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        ground_truth_from_mapping(data, source="hw.json")
    assert str(exc.value).startswith("hw.json"), exc.value
    assert words in str(exc.value), exc.value


def test_bad_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="hardware file not found"):
        load_ground_truth(tmp_path / "none.json")
    yaml = tmp_path / "hw.yaml"
    yaml.write_text("gpu: H200\n")
    with pytest.raises(InvalidInput, match=r"hw\.yaml: a hardware file is \.json or \.toml"):
        load_ground_truth(yaml)
    broken = tmp_path / "hw.toml"
    broken.write_text("gpu = \n")
    with pytest.raises(InvalidInput, match=r"hw\.toml: not valid TOML"):
        load_ground_truth(broken)
    truncated = tmp_path / "hw.json"
    truncated.write_text('{"gpu": "H2')
    with pytest.raises(InvalidInput, match=r"hw\.json: not valid JSON"):
        load_ground_truth(truncated)


def test_grouped_query_heads_that_fit_are_accepted() -> None:
    assert ground_truth_from_mapping({"model": {"q_heads": 32, "kv_heads": 32}}).model.kv_heads \
        == 32  # multi-head attention: one KV head per query head
    assert ground_truth_from_mapping({"model": {"q_heads": 64, "kv_heads": 8}}).model.q_heads \
        == 64


def test_a_file_that_is_not_a_hardware_file_says_what_it_is(tmp_path: Path) -> None:
    bare = tmp_path / "afile"
    bare.write_text("{}")
    with pytest.raises(InvalidInput) as exc:
        load_ground_truth(bare)
    assert str(exc.value) == f"{bare}: a hardware file is .json or .toml; this one has no suffix"
    yaml = tmp_path / "hw.yaml"
    yaml.write_text("gpu: H200\n")
    with pytest.raises(InvalidInput) as exc:
        load_ground_truth(yaml)
    assert "YAML" not in str(exc.value)  # it was never parsed as YAML
    assert str(exc.value).endswith("this one has the suffix '.yaml'"), exc.value
    with pytest.raises(InvalidInput) as exc:
        load_ground_truth(tmp_path)
    assert str(exc.value) == f"hardware file {tmp_path} is a directory, not a file"
    bad = tmp_path / "hw.json"
    bad.write_bytes(b'{"gpu":\n "H2\xff00"}')
    with pytest.raises(InvalidInput, match=r"hw\.json:2: not valid UTF-8 text \(byte 0xff\)"):
        load_ground_truth(bad)
    heads = tmp_path / "heads.toml"
    heads.write_text("[model]\nq_heads = 32\nkv_heads = 64\n")
    with pytest.raises(InvalidInput, match=r"heads\.toml: model\.kv_heads: 64 KV heads exceed"):
        load_ground_truth(heads)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"gpu": "H200"}).encode())
    assert load_ground_truth(bom).gpu == H200


# --- bounds: absurd but finite values are refused up front, naming the key -------------------
@pytest.mark.parametrize(("data", "key"), [
    ({"model": {"layers": 1e9}}, "model.layers"),  # was 0 KV blocks, κ 1e-6, a run never done
    ({"model": {"layers": 10**400}}, "model.layers"),  # a JSON integer of 401 digits
    ({"model": {"hidden": 1 << 30}}, "model.hidden"),
    ({"model": {"q_heads": 1 << 20, "kv_heads": 8}}, "model.q_heads"),
    ({"model": {"head_dim": 10**6}}, "model.head_dim"),
    ({"model": {"experts": 10**9}}, "model.experts"),
    ({"model": {"dense_params_per_layer": 1e20}}, "model.dense_params_per_layer"),
    ({"model": {"expert_params": 1e20}}, "model.expert_params"),
    ({"model": {"dtype_bytes": 16}}, "model.dtype_bytes"),
    ({"model": {"weight_bytes": 1e30}}, "model.weight_bytes"),
    ({"gpu": {"preset": "H200", "peak_flops": 1e300}}, "gpu.peak_flops"),
    ({"memory_gpu": {"preset": "H200", "hbm_bytes": 1e20}}, "memory_gpu.hbm_bytes"),
    ({"gpu": {"preset": "H20", "hbm_bandwidth": 1e30}}, "gpu.hbm_bandwidth"),
    ({"calibration": {"d0": 1e6}}, "calibration.d0"),
    ({"calibration": {"alpha_ag": 5.0}}, "calibration.alpha_ag"),
    ({"calibration": {"sigma": 2.0}}, "calibration.sigma"),
    ({"calibration": {"eta_moe": {"eta_max": 0.7, "x_half": 1e30}}},
     "calibration.eta_moe.x_half"),
    ({"surroundings": {"switch_max_s": 1e9}}, "surroundings.switch_max_s"),
    ({"surroundings": {"kv_capacity_blocks_per_gpu": 10**15}},
     "surroundings.kv_capacity_blocks_per_gpu"),
])
def test_absurd_values_are_refused_naming_the_key(data: Any, key: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        ground_truth_from_mapping(data, source="hw.json")
    assert str(exc.value).startswith(f"hw.json: {key}: must be at most "), exc.value
    assert "far beyond any real model or GPU" in str(exc.value)
    assert len(str(exc.value)) < 200  # a 401-digit integer is not printed whole


def test_every_number_of_a_hardware_file_has_a_bound() -> None:
    """A new field needs its bound (MAXIMA's docstring says why each is what it is); the two
    efficiencies are bounded by 1 where they are checked."""
    from dataclasses import fields

    from sim.groundtruth import Calibration, Efficiency, GpuSpec, ModelSpec, Surroundings
    from sim.hardware import MAXIMA

    numbers = {f.name for cls in (ModelSpec, GpuSpec, Calibration, Efficiency, Surroundings)
               for f in fields(cls) if f.type in ("int", "float", "int | None")}
    assert numbers - set(MAXIMA) == {"bandwidth_efficiency", "eta_max"}
    assert set(MAXIMA) <= numbers


@pytest.mark.parametrize("data", [
    {},
    {"gpu": "H20"}, {"gpu": "H20-3e"}, {"gpu": "H200"},
    {"gpu": "H200", "memory_gpu": "H20"},
    # Llama-3.1-405B's shape (dense: its MLP as one always-routed expert), FP8, on a memory
    # GPU that holds it: every number far inside its bound.
    {"model": {"name": "405B", "layers": 126, "hidden": 16384, "q_heads": 128, "kv_heads": 8,
               "head_dim": 128, "experts": 1, "top_k": 1, "dense_params_per_layer": 8.7e8,
               "expert_params": 2.35e9, "dtype_bytes": 1, "weight_bytes": 4.05e11,
               "elementwise_bytes_per_token_layer": 8e5},
     "gpu": "H20", "memory_gpu": {"preset": "H200", "hbm_bytes": 1e12}},
    # DeepSeek-V3's: 256 routed experts, 8 active.
    {"model": {"name": "V3", "layers": 61, "hidden": 7168, "q_heads": 128, "kv_heads": 1,
               "head_dim": 576, "experts": 256, "top_k": 8, "expert_params": 4.4e7,
               "dtype_bytes": 1, "weight_bytes": 6.71e11},
     "gpu": "H200", "memory_gpu": {"preset": "H200", "hbm_bytes": 1e12}},
])
def test_real_models_and_gpus_pass_the_bounds(data: Any) -> None:
    truth = ground_truth_from_mapping(data)
    assert truth.kv_capacity_blocks(1) >= 1
    assert ground_truth_from_mapping(ground_truth_to_mapping(truth)) == truth


@pytest.mark.parametrize(("data", "words"), [
    # Each number inside its bound, the whole unusable: KV of 4 GB a token fits no GPU.
    ({"model": {"layers": 4096, "kv_heads": 32, "head_dim": 8192}},
     "H20-3e holds no KV block of 512 tokens"),
    # A GPU of 1 FLOP/s: no per-field bound is a lower one.
    ({"gpu": {"preset": "H20", "peak_flops": 1.0}},
     "a prefill of 131,072 tokens on one GPU would take"),
])
def test_hardware_that_no_run_could_use_is_refused(data: Any, words: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        ground_truth_from_mapping(data, source="hw.json")
    assert str(exc.value).startswith("hw.json: not a usable ground truth: "), exc.value
    assert words in str(exc.value), exc.value
