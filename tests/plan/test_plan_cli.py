"""`gptpar plan predict` and `search` in this process, on a synthetic calibration of this machine: the JSON shape,
one-line errors for layouts that cannot exist and calibrations that do not fit, and the search's ranking, rejection
reasons and sweep file."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from planfix import calibration, layout, machine_calibration

from gptpar.cli import main
from gptpar.config import config_from_dict
from gptpar.launch.sweep import expand
from gptpar.plan.search import render

WORDS = ["model.preset=gpt2-tiny", "data.source=synthetic", "data.vocab_size=4096", "data.seq_len=64",
         "train.precision=fp32"]


@pytest.fixture
def calib(tmp_path: Path) -> str:
    return str(machine_calibration(tmp_path / "calib.json"))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_predict_json_is_one_object_with_the_step_and_memory(calib: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "predict", *WORDS, "parallel.dp=2", "parallel.dp_sync=zero2", "--calibration", calib,
                        "--json", "--steps", "100"], capsys)
    assert code == 0
    data = json.loads(out)
    assert {"step_time_s", "tokens_per_s", "memory_bytes", "exposed_comm_s", "bubble_s", "mfu", "cost"} <= set(data)
    assert data["tokens_per_s"] == pytest.approx(16 * 64 / data["step_time_s"])
    assert data["cost"]["gpu_hours"] == pytest.approx(data["step_time_s"] * 100 * 2 / 3600)
    assert data["cost"]["unit"] == "CPU-hours"  # a CPU's hours are not GPU-hours
    assert data["mfu"] is None  # a CPU has no datasheet peak
    code, out, _ = run(["plan", "predict", *WORDS, "--calibration", calib], capsys)
    assert code == 0 and out.splitlines()[1].startswith("step time ")
    assert out.splitlines()[-1].startswith("cost ") and out.splitlines()[-1].endswith(" CPU-hours")


@pytest.mark.parametrize(("words", "message"), [
    (["parallel.tp=3"], "parallel.tp=3 must divide model.n_head=4; use a tp that divides it"),
    (["parallel.pp=8", "parallel.chunks=8", "train.batch_size=8"],
     "parallel.pp * parallel.pp_virtual = 8 stages but the model has 4 blocks; every stage needs at least one block"),
    (["--calibration", "missing.json"], "--calibration 'missing.json' does not exist; name a file written by "
                                        "`gptpar plan calibrate --out FILE`"),
    (["launch.profile=bridges2"], "was made on"),
    (["launch.profile=bridges2", "launch.gpu_type=h100"], "launch.gpu_type=h100: profile bridges2's links and GPU "
                                                          "memory describe v100-32 nodes; plan with "
                                                          "launch.gpu_type=v100-32"),
    (["train.precision=bf16"], "train.precision=bf16 but the calibration was measured in fp32; calibrate with "
                               "--precision bf16, or set train.precision=fp32"),
])
def test_bad_input_is_one_line_and_exit_2(words: list[str], message: str, calib: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    keys = {word.partition("=")[0] for word in words}
    argv = ["plan", "predict", *(w for w in WORDS if w.partition("=")[0] not in keys), *words]
    code, _, err = run([*argv, "--calibration", calib] if "--calibration" not in words else argv, capsys)
    assert code == 2
    assert err.startswith("gptpar: error: ") and message in err and err.count("\n") == 1


def test_no_calibration_for_this_device_says_how_to_make_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "predict", *WORDS], capsys)
    assert (code, err.count("\n")) == (2, 1)
    assert "no calibration for" in err and "python -m gptpar plan calibrate --out FILE" in err


def test_search_ranks_only_valid_layouts_and_names_why_the_rest_fail(calib: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "top.yaml"
    code, out, _ = run(["plan", "search", "--model", "gpt2-tiny", "--gpus", "8", "--profile", "local", *WORDS[1:],
                        "--calibration", calib, "--top", "3", "--sweep", str(sweep)], capsys)
    assert code == 0
    lines = out.splitlines()
    speeds = [float(line.split()[1].replace(",", "")) for line in lines[1:4]]
    assert speeds == sorted(speeds, reverse=True)
    assert "tp=8" not in out.split("rejected")[0]  # 4 heads: tp=8 cannot exist
    assert "x parallel.tp=8 must divide model.n_head=4; use a tp that divides it" in out
    assert "stages but the model has 4 blocks" in out
    name, kind, points = expand(sweep)
    assert (name, kind, len(points)) == ("plan_top", "dp", 3)
    base = yaml.safe_load(sweep.read_text())["base"]  # each run planned: its report sets prediction by measurement
    assert base["report"]["plan_calibration"] == str(Path(calib).resolve())
    for _, words in points:  # every point is a layout the config accepts, on 8 ranks
        cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "train": {"batch_size": 64}})
        from gptpar.config import updated

        pairs = dict(w.split("=", 1) for w in words)
        dp = 8 // (int(pairs["parallel.tp"]) * int(pairs["parallel.pp"]))
        updated(cfg, {**pairs, "parallel.dp": dp})


def test_search_rejects_what_does_not_fit_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "tiny.yaml"
    profile.write_text("device: testgpu\ngpu_type: testgpu\nlinks:\n  gpu_memory_GB: 0.001\n  gpus_per_node: 4\n"
                       "  intra_node: {bandwidth_GBps: 100, latency_us: 5, source: test}\n"
                       "  inter_node: {bandwidth_GBps: 10, latency_us: 10, source: test}\n")
    c = calibration(layout("model.preset=gpt2-tiny"), device_name="TestGPU 16GB")
    file = tmp_path / "gpu.json"
    file.write_text(c.to_json())
    code, out, _ = run(["plan", "search", "--model", "gpt2-tiny", "--gpus", "8", "--profile", str(profile),
                        *WORDS[1:], "--calibration", str(file)], capsys)
    assert code == 0
    assert "0 valid layout(s)" in out and "GB per GPU, over the 0 GB a GPU holds" in out


def test_where_no_whole_sequence_fits_the_search_splits_it_over_cp(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """One head (no tp, no all_to_all) and 4,096 tokens a row on 2 GPUs of 75 MB: the least of the whole-sequence
    layouts needs 86 MB (pp=2, recomputed), cp=2's ring with recompute and 2 micro-steps 67 MB (planned on this
    synthetic calibration)."""
    profile = tmp_path / "small.yaml"
    profile.write_text("device: testgpu\ngpu_type: testgpu\nlinks:\n  gpu_memory_GB: 0.075\n  gpus_per_node: 2\n"
                       "  intra_node: {bandwidth_GBps: 100, latency_us: 5, source: test}\n")
    words = ["model.n_head=1", "data.seq_len=4096", "model.n_positions=4096", "train.batch_size=2"]
    c = calibration(layout("model.preset=gpt2-tiny", *words), device_name="TestGPU 16GB")
    file = tmp_path / "gpu.json"
    file.write_text(c.to_json())
    code, out, _ = run(["plan", "search", "--model", "gpt2-tiny", "--gpus", "2", "--profile", str(profile),
                        *WORDS[1:-2], *words, "--calibration", str(file)], capsys)
    assert code == 0
    ranked = out.split(" valid layout(s)")[0].splitlines()[1:-1]
    assert ranked and all("cp=2 (ring)" in line for line in ranked)
    assert "parallel.cp_impl=all_to_all needs model.n_head=1 divisible by parallel.cp=2" in out


def test_a_profile_without_links_plans_the_users_gpu_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only a profile whose links describe its GPU refuses another launch.gpu_type; one without links plans the
    user's (here the shipped H100 calibration's device), not the profile's own gpu_type."""
    profile = tmp_path / "nolinks.yaml"
    profile.write_text("gpu_type: v100-32\n")
    code, out, _ = run(["plan", "predict", *WORDS[:-1], f"launch.profile={profile}", "launch.gpu_type=h100",
                        "train.precision=bf16"], capsys)
    assert code == 0 and " on h100 " in out.splitlines()[0]


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda c: [c], "a JSON list, not an object"),  # was AttributeError: 'list' object has no attribute 'get'
    (lambda c: {**c, "compute": "fast"}, 'compute is "fast", not an object of [[size, seconds], ...] lists'),
    (lambda c: {**c, "world_size": "2"}, 'world_size is "2", not a whole number >= 1'),
    (lambda c: {**c, "compute": {**c["compute"], "block_f": [[1e9, -0.5]]}},  # was a negative step time
     "compute.block_f[0] is [1000000000.0, -0.5], not [size, seconds] with both finite and > 0"),
    (lambda c: {**c, "compute": {**c["compute"], "block_b": [[1e9, math.nan]]}},  # was NaN, bare in --json
     "compute.block_b[0] is [1000000000.0, NaN], not [size, seconds] with both finite and > 0"),
    (lambda c: {**c, "collectives": {"all_reduce": [[4096.0, 1e-4, 3]]}},
     "collectives.all_reduce[0] is [4096.0, 0.0001, 3], not [size, seconds]"),
    (lambda c: {**c, "activation_bytes_per_token_width": -1}, "activation_bytes_per_token_width is -1, not a finite"),
], ids=["list", "compute-text", "world-size-text", "negative-time", "nan-time", "three-numbers", "negative-bytes"])
def test_a_calibration_of_the_wrong_shape_or_with_impossible_times_is_one_line(
        edit: Callable[[dict], Any], reason: str, calib: str, capsys: pytest.CaptureFixture[str]) -> None:
    Path(calib).write_text(json.dumps(edit(json.loads(Path(calib).read_text()))))
    code, out, err = run(["plan", "predict", *WORDS, "--calibration", calib, "--json"], capsys)
    assert code == 2 and not out
    assert err.startswith(f"gptpar: error: --calibration {calib!r} is not a calibration ({reason}")
    assert err.count("\n") == 1 and err.endswith("); run `python -m gptpar plan calibrate --out FILE` on that device "
                                                 "and pass --calibration FILE\n")


def test_a_search_with_nothing_rejected_ends_its_count_without_a_colon() -> None:
    assert render([], Counter(), {}, 3).splitlines()[-1] == "0 valid layout(s); none rejected"
    reasons = Counter({"parallel.tp=8 must divide model.n_head=4": 2})
    assert render([], reasons, {"parallel.tp=8 must divide model.n_head=4": "tp=8"}, 3).splitlines()[-2:] == [
        "0 valid layout(s); 2 rejected:", "  2 x parallel.tp=8 must divide model.n_head=4 (e.g. tp=8)"]


def test_search_takes_the_image_preset_model_names_for_a_classifier(calib: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--model resolves with the config words (data.task=classify is valid only with an image preset, which the
    default preset is not); a ViT's layouts are data parallel only, the rest refused by the config's own line."""
    sweep = tmp_path / "top.yaml"
    code, out, err = run(["plan", "search", "--model", "vit-tiny", "--gpus", "2", "--profile", "local",
                          "data.task=classify", "data.source=synthetic", "train.precision=fp32",
                          "--calibration", calib, "--top", "2", "--sweep", str(sweep)], capsys)
    assert code == 0, err
    ranked = out.split(" valid layout(s)")[0].splitlines()[1:-1]
    assert ranked and all("dp=2" in line or "dp=1" in line for line in ranked), out
    assert "with model.arch=vit is not built: an image classifier runs whole on each rank" in out
    base = yaml.safe_load(sweep.read_text())["base"]
    assert (base["model"]["preset"], base["data"]["task"]) == ("vit-tiny", "classify")
