"""A planned run's `plan.json`, as a file of its folder: the planner decides what a prediction holds
(gptpar.plan.record), this module how it is kept and read back, so the report reads it without the planner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptpar.atomic import atomic_write_text
from gptpar.run.folder import PLAN_FILE

PREDICTION_KEYS = {"step_time_s", "tokens_per_s", "memory"}  # what every prediction holds


def write_plan_file(folder: Path, record: dict[str, Any]) -> Path:
    """`record` as `folder`/plan.json, atomically (a reader never sees half a prediction)."""
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
    if not isinstance(record, dict) or not PREDICTION_KEYS <= set(record):
        raise ValueError(f"{path}: not a prediction (no step_time_s, tokens_per_s and memory)")
    return record
