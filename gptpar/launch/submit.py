"""`gptpar submit dp|pp`: plan one run, render its job, and hand it to the backend chosen for it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from gptpar.config import Config
from gptpar.launch.backend import Backend, choose_backend, job_text
from gptpar.launch.prepare import Point, prepare_run, write_run_folder
from gptpar.launch.profiles import account_warning, resolve
from gptpar.run.start import location_layer
from gptpar.run.state import LIVE_JOB_STATES, read_run


def dp_set_by(config_file: str | None, origins: Mapping[str, str]) -> bool | None:
    """Whether a submission chose parallel.dp itself (gptpar.cluster.shape.shaped's dp_set): not where it comes from a
    run folder's config.yaml, which records the dp the run's last job shape set, so that the new shape (--gpus,
    --nodes) sets it again and gptpar.run.resume refuses the change of layout, or with --reshape takes it; shaped's
    default elsewhere."""
    return False if config_file and origins.get("parallel.dp") == config_file and location_layer(config_file) else None


def submit(cfg: Config, kind: str, dry_run: bool = False, reshape: bool = False, dp_set: bool | None = None) -> int:
    """Print the job script (--dry-run), or submit it: queued on SLURM, or run now as local processes; `dp_set` as
    dp_set_by says."""
    if dry_run:
        point = prepare_run(cfg, kind, write=False, dp_set=dp_set)
        spec = resolve(point.cfg, kind)
        if (warning := account_warning(spec, os.environ)) is not None:
            print(warning, file=sys.stderr)
        print(job_text([point], spec, point.folder.name, point.folder.job_dir), end="")
        return 0
    point, backend, job_id = submit_run(cfg, kind, reshape, dp_set)
    return 0 if report_started(point, backend, job_id) else 1


def submit_run(cfg: Config, kind: str, reshape: bool = False, dp_set: bool | None = None
               ) -> tuple[Point, Backend, str]:
    """Plan one run and hand it to the backend chosen for it; the point, the backend and its job id. Where it runs
    is decided, and a shape it could never start refused, before anything is written (no folder is left behind),
    and said before it starts. With `reshape` a stopped run continues on another layout (gptpar.run.resume)."""
    point = prepare_run(cfg, kind, write=False, dp_set=dp_set)
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
