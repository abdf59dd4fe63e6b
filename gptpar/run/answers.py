"""Each epoch's decoded answers of data.task=sft in the run folder, `answers/epoch<N>.jsonl`: one line per scored
validation sample (`prompt` as the model saw it, its greedy `response`, the `reference`, and whether the final
answers matched: `correct`), so a 0% answer_accuracy can be told apart from a formatting problem by reading them.

A file is written whole and atomically once its epoch is scored. A start that resumes before an epoch's end and
scores it again finds the file there and keeps it: a completed epoch's answers are never overwritten, the folder
only gains the epochs that follow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptpar.atomic import atomic_write_text

ANSWERS_DIR = "answers"
FIELDS = ("prompt", "response", "reference", "correct")


def answers_path(run_dir: str | Path, epoch: int) -> Path:
    return Path(run_dir) / ANSWERS_DIR / f"epoch{epoch}.jsonl"


def write_answers(run_dir: str | Path, epoch: int, rows: list[dict[str, Any]]) -> bool:
    """Write epoch `epoch`'s answers (dicts of FIELDS) unless its file exists; returns whether it wrote."""
    path = answers_path(run_dir, epoch)
    if path.exists():
        return False
    atomic_write_text(path, "".join(json.dumps({key: row[key] for key in FIELDS}) + "\n" for row in rows))
    return True


def read_answers(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Every epoch's answers in the run folder, by epoch ({} when there are none)."""
    folder = Path(run_dir) / ANSWERS_DIR
    epochs = {}
    for path in folder.glob("epoch*.jsonl") if folder.is_dir() else []:
        number = path.stem.removeprefix("epoch")
        if number.isdigit():
            epochs[int(number)] = [row for line in path.read_text().splitlines() if (row := _row(line)) is not None]
    return dict(sorted(epochs.items()))


def _row(line: str) -> dict[str, Any] | None:
    """A line's answer; None for one that is not (edited by hand: the writer writes whole files)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and set(FIELDS) <= set(row) else None
