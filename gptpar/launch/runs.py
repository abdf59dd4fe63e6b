"""Run folders and their states, from the job record, the controller and the rank-0 log.

A run folder is laid out the same way on every cluster: config.yaml, rank<R>.jsonl,
job/ (submit.sbatch, job.json, job stdout/stderr). The state never needs sacct, and a job the
controller has forgotten is decided from its logs, so nothing is polled forever.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gptpar.launch.cluster import slurm_state
from gptpar.logs import rank_log_path

STATES = ("pending", "running", "completed", "failed", "timeout", "oom")


def job_dir(run_dir: Path) -> Path:
    return run_dir / "job"


def write_job_record(run_dir: Path, cluster: str, job_id: str) -> None:
    path = job_dir(run_dir) / "job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cluster": cluster, "job_id": job_id}) + "\n")


def read_job_record(run_dir: Path) -> dict[str, str]:
    path = job_dir(run_dir) / "job.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL log; a torn last line (a killed writer) is skipped."""
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _job_text(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(job_dir(run_dir).glob("*.err"))
                     if p.is_file())


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _from_logs(run_dir: Path, records: list[dict[str, Any]], job_known: bool) -> str:
    last = records[-1] if records else None
    if last and last.get("kind") == "final" and last.get("status") == "completed":
        return "completed"
    text = _job_text(run_dir)
    if "DUE TO TIME LIMIT" in text:
        return "timeout"
    if "out of memory" in text.lower() or "oom-kill" in text.lower() or "MemoryError" in text:
        return "oom"
    if not job_known and (last is None or last.get("kind") != "final"):
        return "running"  # a plain `gptpar train` without a job record: nothing else to ask
    return "failed"


REQUEUE_GRACE_S = 60.0


def _requeue_in_flight(records: list[dict[str, Any]]) -> bool:
    """The log says "requeued" a moment before SLURM shows the job pending again; past the grace
    period a requeue that never happened is a failure, not something to wait for."""
    last = records[-1] if records else {}
    return (last.get("kind") == "final" and last.get("status") == "requeued"
            and time.time() - float(last.get("time", 0)) < REQUEUE_GRACE_S)


def run_state(run_dir: str | Path) -> str:
    """One of STATES."""
    run_dir = Path(run_dir)
    records = read_records(rank_log_path(run_dir, 0))
    job = read_job_record(run_dir)
    if not job:
        headers = [r for r in records if r.get("kind") == "header"]
        slurm = headers[-1].get("slurm") if headers else None
        if isinstance(slurm, dict) and slurm.get("job_id"):
            job = {"cluster": "slurm", "job_id": str(slurm["job_id"])}
    if job.get("cluster") == "slurm":
        state = slurm_state(job["job_id"])
        if state in ("pending", "running", "timeout", "oom", "failed"):
            return state
        if _requeue_in_flight(records):
            return "pending"
    elif job.get("cluster") == "local" and _pid_alive(job.get("job_id", "")):
        return "running"
    return _from_logs(run_dir, records, job_known=bool(job))


def find_runs(runs_dir: str | Path) -> list[Path]:
    """Run folders under runs_dir (sweeps nest them one level deeper)."""
    root = Path(runs_dir)
    found = {p.parent for p in root.rglob("config.yaml") if p.parent != root}
    return sorted(found)


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_records(rank_log_path(run_dir, 0)) if r.get("kind") == "step"]
    return max(steps, default=0)
