"""`gptpar submit dp|pp`: plan one run, render its job, and hand it to the backend chosen for it."""

from __future__ import annotations

import os
import sys

from gptpar.config import Config
from gptpar.launch.backend import Backend, choose_backend, job_text
from gptpar.launch.prepare import Point, prepare_run, write_run_folder
from gptpar.launch.profiles import account_warning, resolve
from gptpar.run.state import LIVE_JOB_STATES, read_run


def submit(cfg: Config, kind: str, dry_run: bool = False, reshape: bool = False) -> int:
    """Print the job script (--dry-run), or submit it: queued on SLURM, or run now as local processes."""
    if dry_run:
        point = prepare_run(cfg, kind, write=False)
        spec = resolve(point.cfg, kind)
        if (warning := account_warning(spec, os.environ)) is not None:
            print(warning, file=sys.stderr)
        print(job_text([point], spec, point.folder.name, point.folder.job_dir), end="")
        return 0
    point, backend, job_id = submit_run(cfg, kind, reshape)
    return 0 if report_started(point, backend, job_id) else 1


def submit_run(cfg: Config, kind: str, reshape: bool = False) -> tuple[Point, Backend, str]:
    """Plan one run and hand it to the backend chosen for it; the point, the backend and its job id. Where it runs
    is decided, and a shape it could never start refused, before anything is written (no folder is left behind),
    and said before it starts. With `reshape` a stopped run continues on another layout (gptpar.run.resume)."""
    point = prepare_run(cfg, kind, write=False)
    spec = resolve(point.cfg, kind)
    backend = choose_backend(point.cfg.launch)
    backend.check(spec)
    write_run_folder(point.folder, point.cfg, again="move the old folder away to start over", reshape=reshape)
    print(f"{kind} run {point.folder.path}: {spec.nodes * spec.tasks_per_node} rank(s) on {backend.where}",
          flush=True)
    (job_id,) = backend.submit([point], spec, point.folder.name, point.folder.job_dir)
    return point, backend, job_id


def report_started(point: Point, backend: Backend, job_id: str) -> bool:
    """Say what became of a point just handed to a backend (queued, or already run); False if it failed."""
    run = read_run(point.folder, scheduler=backend.state(job_id))
    print(f"{point.folder.name}: {run.state} (job {job_id})" + (f": {run.detail}" if run.detail else ""),
          flush=True)
    return run.state in (*LIVE_JOB_STATES, "completed", "requeued")
