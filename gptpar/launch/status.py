"""`gptpar status`: the runs under a folder as a table a user reads like `squeue`, from the run folders (their
logs and job records) and the scheduler, by the one set of state rules (gptpar.run.state)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from gptpar.launch.backend import job_of, scheduler_state
from gptpar.run.folder import RunFolder, find_runs
from gptpar.run.names import replaced
from gptpar.run.state import STATES, RunLog, last_step, read_run

LIVE = ("pending", "running")
COLUMNS = ("STATE", "RUN", "JOB", "ELAPSED", "STEP", "LOSS", "TOK/S", "NODES", "RESTARTS")


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

    def cells(self) -> tuple[str, ...]:
        elapsed = "-" if self.elapsed_s is None else _duration(self.elapsed_s)
        step = f"{self.step}/{self.total_steps}" if self.total_steps else str(self.step)
        loss = "-" if self.loss is None or not math.isfinite(self.loss) else f"{self.loss:.4f}"
        rate = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f}"
        return self.state, self.run, self.job, elapsed, step, loss, rate, self.nodes or "-", str(self.restarts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def row_of(run: RunLog, root: Path, now: float) -> StatusRow:
    """One run's row: its last step as its ranks logged it (loss: the global mean; tokens/s: summed over one rank
    per data-parallel replica, the one holding the loss), wall time since its first start."""
    started = [log for log in run.ranks if log.headers]
    job = job_of(run.folder)
    headers = [log.headers[-1] for log in started]
    step = last_step(run)
    replicas = _replica_ranks(started)
    last = [log.steps[step] for log in replicas if step in log.steps]
    loss = next((r.get("global_loss", r.get("loss")) for r in last if r.get("global_loss", r.get("loss")) is not None),
                None)
    first = min((float(log.headers[0]["start_time"]) for log in started if "start_time" in log.headers[0]),
                default=None)
    end = now if run.state == "running" else max((log.last_time for log in started), default=now)
    totals = [int(h["total_steps"]) for h in headers if h.get("total_steps")]
    return StatusRow(
        state=run.state, run=run.folder.path.relative_to(root).as_posix(), job=job[1] if job else "-",
        elapsed_s=None if first is None else max(0.0, end - first), step=step,
        total_steps=max(totals) if totals else None, loss=loss,
        tokens_per_s=sum(r["tokens_per_s"] for r in last) if last else None,
        nodes=",".join(sorted({str(h.get("host", "?")) for h in headers})),
        restarts=max((int(h.get("restart", 0)) for h in headers), default=0), detail=run.detail)


def _replica_ranks(started: list) -> list:
    """One rank per data-parallel replica: its last pipeline stage, tensor-parallel rank 0."""
    last_stage = max((log.headers[-1].get("coords", {}).get("pp", 0) for log in started), default=0)
    return [log for log in started if log.headers[-1].get("coords", {}).get("pp", 0) == last_stage
            and log.headers[-1].get("coords", {}).get("tp", 0) == 0]


def status_rows(root: Path, now: float | None = None) -> tuple[list[StatusRow], int]:
    """Every current run under `root`, ordered by state, and the count of folders set aside (not listed)."""
    now = time.time() if now is None else now
    folders = find_runs(root)
    aside = [f for f in folders if replaced(f.name)]  # results of an earlier config, kept but not current
    runs = [read_run(folder, root, scheduler_state(folder), now) for folder in folders if folder not in aside]
    rows = [row_of(run, root, now) for state in STATES for run in runs if run.state == state]
    return rows, len(aside)


def render_status(rows: list[StatusRow], aside: int) -> str:
    """The table, a line of detail under each run that is not completed, and a count by state."""
    cells = [COLUMNS, *(row.cells() for row in rows)]
    widths = [max(len(cell[i]) for cell in cells) for i in range(len(COLUMNS))]
    lines = []
    for row, cell in zip([None, *rows], cells, strict=True):
        lines.append("  ".join(text.ljust(width) for text, width in zip(cell, widths, strict=True)).rstrip())
        if row is not None and row.detail and row.state != "completed":
            lines.append(f"    {row.detail}")
    counts = ", ".join(f"{sum(r.state == s for r in rows)} {s}" for s in STATES if any(r.state == s for r in rows))
    lines.append(f"{len(rows)} run(s): {counts or 'none'}" + (f"; {aside} folder(s) set aside by --rerun or "
                                                               "--start-over not listed" if aside else ""))
    return "\n".join(lines)


def any_live(rows: list[StatusRow]) -> bool:
    return any(row.state in LIVE for row in rows)


def completion_line(folder: RunFolder) -> str:
    """What a finished run achieved, in one line (printed when `gptpar train` returns)."""
    run = read_run(folder, scheduler=scheduler_state(folder))
    if run.state != "completed":
        return f"gptpar: run {run.state}" + (f": {run.detail}" if run.detail else "")
    row = row_of(run, folder.path.parent, time.time())
    replicas = _replica_ranks([log for log in run.ranks if log.headers])
    vals = [r["val_loss"] for log in replicas for r in (*log.evals.values(), *log.epochs.values())
            if isinstance(r.get("val_loss"), float)]
    cells = row.cells()
    return (f"gptpar: run completed: {cells[4]} steps, loss {cells[5]}"
            + (f", val_loss {sum(vals[-len(replicas):]) / len(replicas):.4f}" if vals else "")
            + f", {cells[6]} tok/s, {cells[3]} in {folder.path}")
