"""A planned run (report.plan_calibration): its folder gets plan.json, the prediction `gptpar plan predict` makes of
its config, before any rank starts; `gptpar report` sets it beside the measurement; a calibration that does not fit
stops the submission in one line naming the key. In this process, on a synthetic calibration of this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from logsets import T0, dp_run
from planfix import calibration, layout, machine_calibration

from analysis.report import analyse_runs
from analysis.summary import markdown
from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch.prepare import prepare_run
from gptpar.plan.commands import predict_config
from gptpar.run.folder import PLAN_FILE
from gptpar.run.plan_file import read_plan

WORDS = ["model.preset=gpt2-tiny", "data.source=synthetic", "data.vocab_size=4096", "data.seq_len=64",
         "train.precision=fp32", "parallel.dp=2", "parallel.dp_sync=zero2", "launch.profile=local"]


@pytest.fixture
def calib(tmp_path: Path) -> Path:
    return machine_calibration(tmp_path / "calib.json")


def test_a_planned_run_folder_holds_the_prediction_of_its_config(calib: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, [*WORDS, "report.plan_calibration=calib.json", f"log.runs_dir={tmp_path / 'runs'}",
                             "log.run_id=planned"])
    point = prepare_run(cfg)
    plan = read_plan(point.folder.path)
    _, _, expected = predict_config(cfg, str(calib))
    assert plan is not None and plan["step_time_s"] == expected.step_time_s > 0
    assert plan["memory"] == expected.memory and plan["layout"].startswith("dp=2 (zero2)")
    saved = yaml.safe_load(point.folder.config_path.read_text())
    assert saved["report"]["plan_calibration"] == str(calib)  # absolute: the ranks run elsewhere


def test_an_unplanned_run_has_no_plan(tmp_path: Path) -> None:
    point = prepare_run(load_config(None, [*WORDS, f"log.runs_dir={tmp_path}", "log.run_id=plain"]))
    assert not (point.folder.path / PLAN_FILE).exists() and read_plan(point.folder.path) is None


@pytest.mark.parametrize(("setting", "message"), [
    ("missing.json", "missing.json' does not exist; name a file written by `gptpar plan calibrate --out FILE`"),
    ("other", "was made on 'another cpu', but this layout runs on"),
])
def test_a_calibration_that_does_not_fit_stops_the_submission_naming_the_key(
        setting: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if setting == "other":
        setting = str(tmp_path / "other.json")
        Path(setting).write_text(calibration(layout("model.preset=gpt2-tiny"), device_name="another cpu").to_json())
    cfg = load_config(None, [*WORDS, f"report.plan_calibration={setting}", f"log.runs_dir={tmp_path}",
                             "log.run_id=bad"])
    with pytest.raises(GptparError, match="report.plan_calibration") as err:
        prepare_run(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_report_sets_the_plan_beside_the_measurement(tmp_path: Path) -> None:
    """Two ranks at 100 tokens/s, 100 tokens a step: 1.0 s steps, 200 job tokens/s, 16,000 bytes of state each; a
    plan of 0.8 s, 250 tokens/s and 16,000 bytes is 20% low on time and exact on memory."""
    runs = tmp_path / "runs"
    dp_run(runs / "b", [100.0, 100.0], memory=[(1000, 4000, 4000, 8000)] * 2, **{"parallel.dp_sync": "bucketed"})
    plan = {"step_time_s": 0.8, "tokens_per_s": 250.0, "memory": {"state": 16000}, "layout": "dp=2 (bucketed)"}
    (runs / "b" / PLAN_FILE).write_text(json.dumps(plan))
    dp_run(runs / "c", [100.0, 100.0])  # not planned: not in the table
    # fsdp under hpZ, N = 1e6 over 4 ranks: 4e6 bytes of state and an int8 copy of 508,000 (L = 2) on each, both planned
    hpz = {"parallel.dp_sync": "fsdp", "parallel.hpz": True, "parallel.param_comm": "int8"}
    dp_run(runs / "h", [100.0] * 4, memory=[(1_000_000, 1_000_000, 1_000_000, 2_000_000)] * 4,
           memory_fields={"hpz_bytes": 508_000, "hpz_node_size": 2}, **hpz)
    (runs / "h" / PLAN_FILE).write_text(json.dumps({**plan, "tokens_per_s": 500.0, "layout": "dp=4 (fsdp, hpz)",
                                                     "memory": {"state": 4_000_000, "hpz": 507_812}}))
    (runs / "d").mkdir()
    dp_run(runs / "d", [100.0, 100.0])
    (runs / "d" / PLAN_FILE).write_text("{not json")
    metrics = analyse_runs(runs, now=T0 + 3600)
    text = markdown(metrics, metrics, runs, "none")
    section = text.split("## Planned against measured")[1]
    assert "| b | dp=2 (bucketed) | 800.0 | 1000.0 | -20.0% | 250 | 200 | 0.016 | 0.016 | +0.0% |" in section
    assert "| c |" not in section and "| d |" not in section
    assert "| h | dp=4 (fsdp, hpz) | 800.0 | 1000.0 | -20.0% | 500 | 400 | 4.508 | 4.508 | -0.0% |" in section
    assert any(f"{runs / 'd' / PLAN_FILE}: not a prediction" in w for m in metrics for w in m.warnings)
