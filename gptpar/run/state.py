"""A run's state, decided in one place from its records, its lock and the scheduler's answer.

The scheduler's answer is passed in (this module never asks SLURM itself), so `gptpar status`
(which asks), `gptpar report` (which does not) and the trainer's resume all use the same rules:
- pending: the scheduler says the job waits (also right after a requeue);
- running: the run's lock is held (or its heartbeat is fresh), or the scheduler says it runs;
- otherwise the logs decide: completed (every rank's last segment says so), diverged (completed
  with a non-finite loss), failed (a rank says failed, or died without a final record, or never
  wrote one), timeout / oom (from the scheduler or the job's stderr), requeued (the log says so and
  no scheduler says the job waits), corrupt (an unreadable log).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptpar.run.folder import RunFolder
from gptpar.run.logfile import CorruptLog, RankLog, read_rank_log

STATES = ("pending", "running", "completed", "diverged", "requeued", "failed", "timeout", "oom", "corrupt")
SCHEDULER_STATES = ("pending", "running", "completed", "failed", "timeout", "oom")
REQUEUE_GRACE_S = 60.0  # a "requeued" final record precedes the scheduler showing the job pending


@dataclass
class RunLog:
    """A run folder read whole: config, each rank's stitched log, and its state."""

    folder: RunFolder
    sweep: str  # the folders between the runs folder and the run; "" for a top-level run
    config: dict[str, Any]
    ranks: list[RankLog]
    state: str
    detail: str = ""  # why the run is not completed, in one line
    warnings: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.folder.name


def _last_line(paths: list[Path]) -> str:
    for path in reversed(paths):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return f"{path.name}: {lines[-1][:300]}"
    return ""


def _job_text(folder: RunFolder) -> str:
    return "\n".join(p.read_text(errors="replace") for p in folder.job_errors())


def _diverged(log: RankLog) -> bool:
    if not log.steps:
        return False
    loss = log.steps[max(log.steps)]["loss"]
    return isinstance(loss, float) and not math.isfinite(loss)


def decide_state(folder: RunFolder, ranks: list[RankLog], scheduler: str | None, now: float) -> tuple[str, str]:
    """(state, detail) of a run that is not corrupt; `scheduler` is one of SCHEDULER_STATES or None."""
    if scheduler == "pending":
        return "pending", "queued"
    holder = folder.holder()
    if holder is not None or scheduler == "running":
        where = f"host {holder.get('host')} pid {holder.get('pid')}" if holder else "the scheduler says so"
        return "running", f"running ({where})"
    started = [log for log in ranks if log.headers]
    expected = max((int(log.header["world_size"]) for log in started), default=0)
    finals = {log.rank: log.final for log in started}
    failed = [(r, f) for r, f in finals.items() if f is not None and f["status"] == "failed"]
    if failed:
        rank, final = failed[0]
        return "failed", f"rank {rank} failed at step {final['step']}: {final.get('error', 'no error recorded')}"
    requeued = [f for f in finals.values() if f is not None and f["status"] == "requeued"]
    if requeued and scheduler is None and now - float(requeued[0]["time"]) < REQUEUE_GRACE_S:
        return "pending", "requeued; waiting for the scheduler to restart it"
    if started and len(started) >= expected and all(f is not None and f["status"] == "completed"
                                                    for f in finals.values()):
        if any(_diverged(log) for log in started):
            return "diverged", "completed with a non-finite loss"
        return "completed", ""
    text = _job_text(folder)
    if scheduler in ("timeout", "oom"):
        return scheduler, f"the scheduler reports {scheduler}"
    if "DUE TO TIME LIMIT" in text:
        return "timeout", "the job hit its time limit"
    if "out of memory" in text.lower() or "oom-kill" in text.lower() or "MemoryError" in text:
        return "oom", "out of memory"
    if requeued:
        return "requeued", f"requeued at step {requeued[0]['step']}; no scheduler reports it waiting"
    reason = _last_line(folder.job_errors())
    if not started:
        return "failed", "died before its first log record" + (f" ({reason})" if reason else "")
    silent = [log for log in started if log.final is None] or started
    age = now - max(log.last_time for log in silent)
    missing = sorted(set(range(expected)) - {log.rank for log in started})
    who = f"rank {silent[0].rank}" if not missing else f"rank {missing[0]}"
    return "failed", (f"{who} died without a final record (last record {age / 60:.0f} min ago)"
                      + (f"; {reason}" if reason else ""))


def read_run(folder: RunFolder, runs_dir: str | Path | None = None, scheduler: str | None = None,
             now: float | None = None) -> RunLog:
    """Read one run; a corrupt log makes the run "corrupt" instead of failing the caller."""
    now = time.time() if now is None else now
    sweep = ""
    if runs_dir is not None:
        rel = folder.path.relative_to(Path(runs_dir))
        sweep = rel.parent.as_posix() if rel.parent != Path(".") else ""
    warnings: list[str] = []
    try:
        config = folder.read_config() or {}
    except Exception as exc:  # a hand-edited config.yaml must not hide the run's logs
        config, warnings = {}, [f"{folder.config_path}: unreadable ({type(exc).__name__})"]
    try:
        ranks = [read_rank_log(p, warnings) for p in folder.rank_logs()]
    except CorruptLog as exc:
        return RunLog(folder, sweep, config, [], "corrupt", str(exc), warnings)
    started = [log for log in ranks if log.headers]
    if started:
        config = started[0].header["config"]  # what ran: the rank side adds the launcher's world size
        world = int(started[0].header["world_size"])
        if len(ranks) < world:
            warnings.append(f"{folder.path}: {len(ranks)} rank file(s) for world_size {world}")
    state, detail = decide_state(folder, ranks, scheduler, now)
    return RunLog(folder, sweep, config, started, state, detail, warnings)


def last_step(run: RunLog) -> int:
    return max((max(log.steps) for log in run.ranks if log.steps), default=0)
