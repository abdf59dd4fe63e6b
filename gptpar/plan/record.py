"""A planned run's prediction, `plan.json` in its folder: written when the folder is made (before any rank starts,
so the prediction cannot be fitted to the run), read by `gptpar report` (through gptpar.run.plan_file, the file's
one home) to set it beside what the run measured."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from gptpar.config import Config
from gptpar.plan.commands import as_json, predict_config
from gptpar.run.plan_file import write_plan_file

SHIPPED = "shipped"  # report.plan_calibration's word for the shipped calibration of the job's device


def write_plan(folder: Path, cfg: Config) -> Path:
    """Predict `cfg` with report.plan_calibration (as `gptpar plan predict --json` does) into `folder`/plan.json. A
    missing or unfitting calibration stops the submission in one line, as it stops `plan predict`."""
    name = cfg.report.plan_calibration
    layout, target, pred = predict_config(cfg, None if name == SHIPPED else name, "report.plan_calibration")
    record = json.loads(as_json(layout, target, pred, cfg.train.max_steps))
    record["planned_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return write_plan_file(folder, record)
