"""`gptpar submit dp|pp`: plan one run, render its job, and hand it to the backend chosen for it."""

from __future__ import annotations

from gptpar.config import Config
from gptpar.launch.backend import choose_backend
from gptpar.launch.plan import plan_run
from gptpar.launch.profiles import resolve
from gptpar.launch.render import render_script
from gptpar.run.state import read_run


def submit(cfg: Config, kind: str, dry_run: bool = False) -> int:
    """Print the job script (--dry-run), or submit it: queued on SLURM, or run now as local processes."""
    point = plan_run(cfg, kind, write=not dry_run)
    spec = resolve(point.cfg, kind)
    if dry_run:
        print(render_script([point], spec, point.folder.name, point.folder.job_dir), end="")
        return 0
    backend = choose_backend(point.cfg.launch.cluster, point.cfg.launch.profile)
    print(f"{kind} run {point.folder.path}: {spec.nodes * spec.tasks_per_node} rank(s) on {backend.where}",
          flush=True)
    (job_id,) = backend.submit([point], spec, point.folder.name, point.folder.job_dir)
    if backend.name == "slurm":
        print(f"submitted job {job_id}")
        return 0
    run = read_run(point.folder)
    print(f"{kind} run {run.state}" + (f": {run.detail}" if run.detail else "") + f" ({point.folder.path})")
    return 0 if run.state in ("completed", "pending") else 1
