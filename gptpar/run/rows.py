"""One run's status row, from its folder alone (its logs and job record, by gptpar.run.state's rules): the row
`gptpar status` lists, and as Python values (`run_result`) the Python API's and a submitit job's result, which a
compute node's task reads without the launcher's status table."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLog
from gptpar.run.segments import segments
from gptpar.run.state import RunLog, job_of, last_step, read_run, replica_indices
from gptpar.run.stragglers import straggler_note

FAILURES = ("failed", "timeout", "oom", "corrupt")  # a run in these states has no result, only a reason
COLUMNS = ("STATE", "RUN", "JOB", "ELAPSED", "STEP", "ETA", "LOSS", "TOK/S", "NODES", "RESTARTS")
RATE_STEPS = 20  # the ETA's step rate is that of the last this many steps of the current start


@dataclass(frozen=True)
class StatusRow:
    state: str
    run: str
    job: str
    elapsed_s: float | None
    step: int
    total_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    nodes: str
    restarts: int
    detail: str
    mixed: str = ""  # why its starts ran different configs (flagged under the row whatever its state)
    reshaped: str = ""  # how it continued on other layouts, to the current one (noted under the row)
    segments: tuple[str, ...] = ()  # a reshaped run's segments, one line each (gptpar.run.segments)
    eta_s: float | None = None  # a running run's time to its last step at its recent step rate
    straggler: str = ""  # its ranks whose compute stays above their peers' (gptpar.run.stragglers), noted under the row

    def cells(self) -> tuple[str, ...]:
        elapsed = "-" if self.elapsed_s is None else _duration(self.elapsed_s)
        step = f"{self.step}/{self.total_steps}" if self.total_steps else str(self.step)
        eta = "-" if self.eta_s is None else _duration(self.eta_s)
        loss = "-" if self.loss is None or not math.isfinite(self.loss) else f"{self.loss:.4f}"
        rate = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f}"
        return (self.state, self.run, self.job, elapsed, step, eta, loss, rate, self.nodes or "-",
                str(self.restarts))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


Job = tuple[str, str] | None  # (backend, job id), as job_of names it


def replica_logs(run: RunLog) -> list[RankLog]:
    """The started rank logs of one rank per data-parallel replica (the one holding the loss)."""
    started = [log for log in run.ranks if log.headers]
    return [started[i] for i in replica_indices(started)] if started else []


def _eta(log: RankLog, total: int | None) -> float | None:
    """Seconds to the last step at the rate of the last RATE_STEPS steps of this start (steps before a restart ran
    at another time); None without two such steps."""
    start = float(log.headers[-1].get("start_time", 0.0))
    recent = [r for _, r in sorted(log.steps.items()) if float(r["time"]) >= start][-RATE_STEPS:]
    if not total or len(recent) < 2 or recent[-1]["time"] <= recent[0]["time"]:
        return None
    rate = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["time"] - recent[0]["time"])
    return max(0, total - recent[-1]["step"]) / rate


def row_of(run: RunLog, job: Job, root: Path, now: float) -> StatusRow:
    """One run's row: its last step as its ranks logged it (loss: the global mean; tokens/s: summed over one rank
    per data-parallel replica), wall time since its job started (the latest start: a requeued job's time in the
    queue is not counted, as squeue's TIME does not), and a running run's ETA from its recent step rate."""
    started = [log for log in run.ranks if log.headers]
    headers = [log.headers[-1] for log in started]
    step = last_step(run)
    last = [log.steps[step] for log in replica_logs(run) if step in log.steps]
    loss = next((r.get("global_loss", r.get("loss")) for r in last if r.get("global_loss", r.get("loss")) is not None),
                None)
    first = min((float(log.headers[-1]["start_time"]) for log in started if "start_time" in log.headers[-1]),
                default=None)
    end = now if run.state == "running" else max((log.last_time for log in started), default=now)
    totals = [int(h["total_steps"]) for h in headers if h.get("total_steps")]
    replicas = replica_logs(run)
    eta = _eta(replicas[0], max(totals, default=None)) if run.state == "running" and replicas else None
    return StatusRow(
        state=run.state, run=run.folder.path.relative_to(root).as_posix(), job=job[1] if job else "-",
        elapsed_s=None if first is None else max(0.0, end - first), step=step,
        total_steps=max(totals) if totals else None, loss=loss,
        tokens_per_s=sum(r["tokens_per_s"] for r in last) if last else None,
        nodes=",".join(sorted({str(h.get("host", "?")) for h in headers})),
        restarts=max((int(h.get("restart", 0)) for h in headers), default=0), detail=run.detail, mixed=run.mixed,
        reshaped=run.reshaped, segments=tuple(s.line() for s in segments(run.ranks)) if run.reshaped else (),
        eta_s=eta, straggler=straggler_note(run))


def run_result(folder: RunFolder, scheduler: str | None = None) -> dict[str, Any]:
    """A run's row as Python values, with rank 0's last final record (its `status`, the report's word; also `state`);
    `scheduler` is its job's state (a job's own tasks pass None). A failed run (FAILURES) has no result: a one-line
    GptparError says why."""
    run = read_run(folder, scheduler=scheduler)
    if run.state in FAILURES:
        raise GptparError(f"run {folder.path} {run.state}" + (f": {run.detail}" if run.detail else ""))
    job = job_of(folder)
    row = row_of(run, job, folder.path.parent, time.time())
    return {"run_id": folder.name, "run_dir": str(folder.path), "status": run.state, "detail": run.detail,
            "job_id": job[1] if job else None, "step": row.step, "total_steps": row.total_steps,
            "final_loss": row.loss, "tokens_per_s": row.tokens_per_s, "elapsed_s": row.elapsed_s,
            "final": next((log.final for log in run.ranks if log.rank == 0), None),
            "state": run.state}  # `status` under its first name, for code written before it matched the report's
