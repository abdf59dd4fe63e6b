"""A planned run's prediction, `plan.json` in its folder: written when the folder is made (before any rank starts,
so the prediction cannot be fitted to the run), read by `gptpar report` to set it beside what the run measured."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from gptpar.atomic import atomic_write_text
from gptpar.config import Config
from gptpar.run.folder import PLAN_FILE

SHIPPED = "shipped"  # report.plan_calibration's word for the shipped calibration of the job's device


def write_plan(folder: Path, cfg: Config) -> Path:
    """Predict `cfg` with report.plan_calibration (as `gptpar plan predict --json` does) into `folder`/plan.json. A
    missing or unfitting calibration stops the submission in one line, as it stops `plan predict`."""
    from gptpar.plan.commands import as_json, predict_config

    name = cfg.report.plan_calibration
    layout, target, pred = predict_config(cfg, None if name == SHIPPED else name, "report.plan_calibration")
    record = json.loads(as_json(layout, target, pred, cfg.train.max_steps))
    record["planned_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    path = folder / PLAN_FILE
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def read_plan(folder: Path) -> dict[str, Any] | None:
    """The run's prediction, None when it was not planned; a file that is not a prediction is an error, not
    silently no plan."""
    path = folder / PLAN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a prediction ({exc})") from None
    if not isinstance(record, dict) or not {"step_time_s", "tokens_per_s", "memory"} <= set(record):
        raise ValueError(f"{path}: not a prediction (no step_time_s, tokens_per_s and memory)")
    return record
