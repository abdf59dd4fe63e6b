"""Per-rank JSONL logs: one file per rank per run, appended and flushed record by record.

A killed job keeps every record it wrote; a requeued job appends a new header (a new segment)
to the same file, so the analysis can stitch segments together without counting a step twice.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# Required fields of each record kind; every record also carries "kind" and "time" (unix seconds).
SCHEMA: dict[str, tuple[str, ...]] = {
    "header": (
        "schema_version", "run_id", "config", "rank", "world_size", "coords", "sizes",
        "restart", "host", "device", "torch_version", "transformers_version", "git_commit",
        "slurm", "start_time",
    ),
    "step": (
        "step", "epoch", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s",
        "data_time_s", "peak_mem_bytes",
    ),
    "eval": ("step", "epoch", "val_loss"),
    "epoch": ("epoch", "training_time_s", "tokens_per_s", "val_loss", "steps"),
    "final": ("status", "step"),
}

FINAL_STATUSES = ("completed", "failed", "requeued")


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.jsonl"


def validate_record(record: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing field, so a bad log is reported precisely."""
    kind = record.get("kind")
    if kind not in SCHEMA:
        raise ValueError(f"unknown record kind {kind!r}; allowed: {', '.join(SCHEMA)}")
    missing = [k for k in (*SCHEMA[kind], "time") if k not in record]
    if missing:
        raise ValueError(f"{kind} record lacks field(s): {', '.join(missing)}")
    if kind == "final" and record["status"] not in FINAL_STATUSES:
        raise ValueError(f"final status {record['status']!r}; allowed: {', '.join(FINAL_STATUSES)}")


class RankLogger:
    """Appends validated records to `runs/<run_id>/rank<R>.jsonl`, flushing and fsync-ing each one."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.path = rank_log_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, "time": time.time(), **fields}
        validate_record(record)
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        return record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
