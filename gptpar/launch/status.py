"""`gptpar status`: the runs under a folder as a table a user reads like `squeue`, from the run folders (their
logs and job records) and the scheduler, by the one set of state rules (gptpar.run.state); and one run's row
as Python values (`run_result`: the Python API's and a submitit job's result)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpar.errors import GptparError
from gptpar.launch.backend import job_of, job_state
from gptpar.launch.slurm import PlainJob, plain_jobs
from gptpar.run.folder import RunFolder, find_runs
from gptpar.run.logfile import RankLog
from gptpar.run.names import replaced
from gptpar.run.records import EPOCH_SCORES
from gptpar.run.state import LIVE_JOB_STATES, STATES, RunLog, last_step, read_run, replica_indices

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
    eta_s: float | None = None  # a running run's time to its last step at its recent step rate

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


def _replicas(run: RunLog) -> list[RankLog]:
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
    last = [log.steps[step] for log in _replicas(run) if step in log.steps]
    loss = next((r.get("global_loss", r.get("loss")) for r in last if r.get("global_loss", r.get("loss")) is not None),
                None)
    first = min((float(log.headers[-1]["start_time"]) for log in started if "start_time" in log.headers[-1]),
                default=None)
    end = now if run.state == "running" else max((log.last_time for log in started), default=now)
    totals = [int(h["total_steps"]) for h in headers if h.get("total_steps")]
    replicas = _replicas(run)
    eta = _eta(replicas[0], max(totals, default=None)) if run.state == "running" and replicas else None
    return StatusRow(
        state=run.state, run=run.folder.path.relative_to(root).as_posix(), job=job[1] if job else "-",
        elapsed_s=None if first is None else max(0.0, end - first), step=step,
        total_steps=max(totals) if totals else None, loss=loss,
        tokens_per_s=sum(r["tokens_per_s"] for r in last) if last else None,
        nodes=",".join(sorted({str(h.get("host", "?")) for h in headers})),
        restarts=max((int(h.get("restart", 0)) for h in headers), default=0), detail=run.detail, mixed=run.mixed,
        eta_s=eta)


def _read(folder: RunFolder, root: Path | None = None, now: float | None = None) -> tuple[RunLog, Job]:
    """A run folder read with its job's scheduler state, and the job (looked up once)."""
    job = job_of(folder)
    return read_run(folder, root, job_state(job), now), job


def parse_states(text: str) -> tuple[str, ...]:
    """`--state running,pending`: the states to list, each one of STATES."""
    states = tuple(word.strip() for word in text.split(",") if word.strip())
    wrong = [state for state in states if state not in STATES]
    if wrong or not states:
        raise GptparError(f"--state {text!r}: {'no state named' if not wrong else repr(wrong[0]) + ' is not a state'}; "
                          f"choose from {', '.join(STATES)} (comma-separated)")
    return states


def status_rows(root: Path, now: float | None = None,
                states: tuple[str, ...] = STATES) -> tuple[list[StatusRow], int]:
    """Every current run under `root` in one of `states`, ordered by state, and the count of folders set aside (not
    listed). The live jobs of the plain sbatch scripts are SLURM's to tell: one that continues a run folder shows as
    that run, one whose folder does not hold a run yet as a row of its own."""
    now = time.time() if now is None else now
    top = root.resolve()
    plain = {job.run.resolve(): job for job in plain_jobs() if job.run.resolve().is_relative_to(top)}
    folders = find_runs(root)
    aside = [f for f in folders if replaced(f.name)]  # results of an earlier config, kept but not current
    rows = []
    for folder in folders:
        if folder in aside:
            continue
        job = plain.pop(folder.path.resolve(), None)
        if job is None:
            run, found = _read(folder, root, now)
        else:  # a plain script's job continuing this run: SLURM's word on it, not on the job that ran it before
            run, found = read_run(folder, root, job.state, now), ("slurm", job.job_id)
        rows.append(row_of(run, found, root, now))
    rows += [row_of(read_run(RunFolder(job.run), top, job.state, now), ("slurm", job.job_id), top, now)
             for job in plain.values()]  # no run folder yet
    return sorted((row for row in rows if row.state in states), key=lambda row: STATES.index(row.state)), len(aside)


def plain_job_named(name: str, runs_dir: Path) -> PlainJob | None:
    """The live job of a plain script that `name` names: its job id, or its run as `gptpar status` shows it (under
    runs_dir) or as a path."""
    places = {Path(name).resolve(), (runs_dir / name).resolve()}
    return next((job for job in plain_jobs() if job.job_id == name or job.run.resolve() in places), None)


def run_of_job(job_id: str, runs_dir: Path) -> RunFolder | None:
    """The run under runs_dir whose job (job.json's, or a plain script's SLURM job) has this id, as the JOB column
    shows it."""
    return next((folder for folder in find_runs(runs_dir) if (job := job_of(folder)) and job[1] == job_id), None)


def render_status(rows: list[StatusRow], aside: int) -> str:
    """The table, a line of detail under each run that is not completed (and a flag under each whose starts ran
    different configs), and a count by state."""
    cells = [COLUMNS, *(row.cells() for row in rows)]
    widths = [max(len(cell[i]) for cell in cells) for i in range(len(COLUMNS))]
    lines = []
    for row, cell in zip([None, *rows], cells, strict=True):
        lines.append("  ".join(text.ljust(width) for text, width in zip(cell, widths, strict=True)).rstrip())
        if row is not None and row.detail and row.state != "completed":
            lines.append(f"    {row.detail}")
        if row is not None and row.mixed:
            lines.append(f"    warning: {row.mixed}")
    counts = ", ".join(f"{sum(r.state == s for r in rows)} {s}" for s in STATES if any(r.state == s for r in rows))
    lines.append(f"{len(rows)} run(s): {counts or 'none'}" + (f"; {aside} folder(s) set aside by --rerun or "
                                                               "--start-over not listed" if aside else ""))
    return "\n".join(lines)


def any_live(rows: list[StatusRow]) -> bool:
    return any(row.state in LIVE_JOB_STATES for row in rows)


def completion(folder: RunFolder) -> tuple[str, str]:
    """A finished run's state and what it achieved, in one line (printed when `gptpar train` returns). The
    validation loss (and a translation run's BLEU, and test BLEU) is the latest logged: every replica logs the one
    over replicas."""
    run, job = _read(folder)
    if run.state != "completed":
        return run.state, f"gptpar: run {run.state}" + (f": {run.detail}" if run.detail else "")
    cells = dict(zip(COLUMNS, row_of(run, job, folder.path.parent, time.time()).cells(), strict=True))
    replicas = _replicas(run)
    records = sorted((*replicas[0].evals.values(), *replicas[0].epochs.values()), key=lambda r: r["time"])
    val = next((r["val_loss"] for r in reversed(records) if isinstance(r.get("val_loss"), float)), None)
    scores = {key: next((r[key] for r in reversed(records) if isinstance(r.get(key), float)), None)
              for key in EPOCH_SCORES}  # the pair tasks'
    return run.state, (f"gptpar: run completed: {cells['STEP']} steps, loss {cells['LOSS']}"
                       + (f", val_loss {val:.4f}" if val is not None else "")
                       + "".join(f", {key} {value:.2f}" for key, value in scores.items() if value is not None)
                       + f", {cells['TOK/S']} tok/s, {cells['ELAPSED']} in {folder.path}")


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
