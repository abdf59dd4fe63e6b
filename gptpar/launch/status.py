"""`gptpar status`: the runs under a folder as a table a user reads like `squeue`, from the run folders (their
logs and job records) and the scheduler, by the one set of state rules (gptpar.run.state); each row is
gptpar.run.rows'."""

from __future__ import annotations

import time
from pathlib import Path

from gptpar.errors import GptparError
from gptpar.launch.backend import job_of, job_state
from gptpar.launch.slurm import PlainJob, plain_jobs
from gptpar.run.folder import RunFolder, find_runs
from gptpar.run.names import replaced
from gptpar.run.records import LINE_SCORES
from gptpar.run.rows import COLUMNS, Job, StatusRow, replica_logs, row_of
from gptpar.run.state import LIVE_JOB_STATES, STATES, RunLog, read_run


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
    different configs, a note under each continued on another layout and its segments, its stragglers), and a count
    by state."""
    cells = [COLUMNS, *(row.cells() for row in rows)]
    widths = [max(len(cell[i]) for cell in cells) for i in range(len(COLUMNS))]
    lines = []
    for row, cell in zip([None, *rows], cells, strict=True):
        lines.append("  ".join(text.ljust(width) for text, width in zip(cell, widths, strict=True)).rstrip())
        if row is not None and row.detail and row.state != "completed":
            lines.append(f"    {row.detail}")
        if row is not None and row.mixed:
            lines.append(f"    warning: {row.mixed}")
        if row is not None and row.reshaped:
            lines.append(f"    note: {row.reshaped}")
            lines += [f"    segment: {segment}" for segment in row.segments]
        if row is not None and row.straggler:
            lines.append(f"    straggler: {row.straggler}")
    counts = ", ".join(f"{sum(r.state == s for r in rows)} {s}" for s in STATES if any(r.state == s for r in rows))
    lines.append(f"{len(rows)} run(s): {counts or 'none'}" + (f"; {aside} folder(s) set aside by --rerun or "
                                                               "--start-over not listed" if aside else ""))
    return "\n".join(lines)


def any_live(rows: list[StatusRow]) -> bool:
    return any(row.state in LIVE_JOB_STATES for row in rows)


def completion(folder: RunFolder) -> tuple[str, str]:
    """A finished run's state and what it achieved, in one line (printed when `gptpar train` returns). The
    validation loss and scores (a classifier's accuracy, a translation run's BLEU and test BLEU, sft's answer
    accuracy) are the latest logged: every replica logs the one over replicas."""
    run, job = _read(folder)
    if run.state != "completed":
        return run.state, f"gptpar: run {run.state}" + (f": {run.detail}" if run.detail else "")
    cells = dict(zip(COLUMNS, row_of(run, job, folder.path.parent, time.time()).cells(), strict=True))
    replicas = replica_logs(run)
    records = sorted((*replicas[0].evals.values(), *replicas[0].epochs.values()), key=lambda r: r["time"])
    val = next((r["val_loss"] for r in reversed(records) if isinstance(r.get("val_loss"), float)), None)
    scores = {key: next((r[key] for r in reversed(records) if isinstance(r.get(key), float)), None)
              for key in LINE_SCORES}  # a classifier's accuracy, the pair tasks' scores
    return run.state, (f"gptpar: run completed: {cells['STEP']} steps, loss {cells['LOSS']}"
                       + (f", val_loss {val:.4f}" if val is not None else "")
                       + "".join(f", {key} {value:.2f}" for key, value in scores.items() if value is not None)
                       + f", {cells['TOK/S']} tok/s, {cells['ELAPSED']} in {folder.path}")
