"""Submit dp/pp runs: write each run folder, then sbatch a rendered script or run local processes.

On SLURM the rendered template is what `sbatch` receives (the same text `--dry-run` prints), so
every value is quoted under our control. Without SLURM, submitit's LocalExecutor runs the ranks as
local tasks; `local_task` turns its JobEnvironment into torchrun-style variables.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gptpar.config import Config, load_config, to_yaml, validate
from gptpar.errors import GptparError
from gptpar.launch import cluster, render
from gptpar.launch.profiles import JobSpec, resolve, time_seconds
from gptpar.launch.runs import job_dir, write_job_record

RUN_ID = re.compile(r"[A-Za-z0-9_.+=,-]+")


@dataclass
class Point:
    """One run to submit: its resolved config and its folder."""

    cfg: Config
    run_dir: Path


def shape(cfg: Config, kind: str) -> Config:
    """Make the training config agree with the job shape: DP ranks = tasks, PP mode for pp jobs."""
    if kind not in ("dp", "pp"):
        raise GptparError(f"job kind {kind!r}: choose dp or pp")
    if kind == "dp":
        cfg.parallel.dp = max(cfg.launch.gpus, 1) * cfg.launch.nodes
    else:
        cfg.parallel.dp = 1
        if cfg.parallel.pp_mode == "single":
            cfg.parallel.pp_mode = "pipeline_parallel"
    validate(cfg)
    return cfg


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+=,-]+", "_", text).strip("_") or "run"


def new_point(cfg: Config, runs_dir: Path | None = None, run_id: str = "") -> Point:
    """Fix the run folder before submission, so every rank and every restart writes there."""
    runs_dir = (runs_dir or Path(cfg.log.runs_dir)).resolve()
    run_id = run_id or cfg.log.run_id
    if run_id and not RUN_ID.fullmatch(run_id):
        raise GptparError(f"log.run_id: {run_id!r} may hold only letters, digits and _ . + = , -")
    if not run_id:
        base = f"{slug(cfg.log.name)}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_id, n = base, 1
        while (runs_dir / run_id).exists():
            n += 1
            run_id = f"{base}-{n}"
    cfg.log.runs_dir, cfg.log.run_id = str(runs_dir), run_id
    return Point(cfg, runs_dir / run_id)


def gptpar_executable(cfg: Config) -> str:
    """launch.venv's gptpar, else the one of the interpreter running now (this checkout's venv)."""
    venv = cfg.launch.venv or sys.prefix
    return str(Path(venv) / "bin" / "gptpar")


def script_for(points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> str:
    cfg = points[0].cfg
    return render.render(spec, name, [p.run_dir for p in points], gptpar_executable(cfg), output_dir,
                         cfg.launch.max_concurrent)


def submit_slurm(points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> str:
    """Write the run folders and sbatch one job (an array for several points); returns the job id."""
    script = script_for(points, spec, name, output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for point in points:
        job_dir(point.run_dir).mkdir(parents=True, exist_ok=True)
        (point.run_dir / "config.yaml").write_text(to_yaml(point.cfg))
        (job_dir(point.run_dir) / "submit.sbatch").write_text(script)
    script_path = job_dir(points[0].run_dir) / "submit.sbatch"
    job_id = cluster.sbatch(str(script_path), cwd=os.getcwd())
    for index, point in enumerate(points):
        write_job_record(point.run_dir, "slurm", f"{job_id}_{index}" if len(points) > 1 else job_id)
    return job_id


def local_task(config_path: str) -> str:
    """Body of a submitit task: set the rank layout from JobEnvironment, then train one rank."""
    import submitit

    from gptpar import preemption, trainer
    from gptpar.distributed import slurm_port

    env = submitit.JobEnvironment()
    per_node = env.num_tasks // max(env.num_nodes, 1)
    os.environ.update({
        "RANK": str(env.global_rank), "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_RANK": str(env.local_rank), "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": env.hostnames[0] if env.cluster == "slurm" else "127.0.0.1",
        "MASTER_PORT": str(slurm_port(env.job_id.split("_")[0])),
    })
    result = trainer.train(load_config(config_path))
    if preemption.was_requeued():
        raise SystemExit(0)  # like submitit's own requeue: no result, the requeued run will write it
    return str(result["status"])


def run_local(point: Point, spec: JobSpec, script: str) -> str:
    """Run the ranks as local processes through submitit's LocalExecutor and wait for them."""
    import submitit

    folder = job_dir(point.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    config_path = point.run_dir / "config.yaml"
    config_path.write_text(to_yaml(point.cfg))
    (folder / "submit.sbatch").write_text(script)
    executor = submitit.LocalExecutor(folder=str(folder))
    executor.update_parameters(tasks_per_node=spec.tasks_per_node * spec.nodes,
                               timeout_min=max(1, time_seconds(spec.time) // 60),
                               signal_delay_s=spec.signal_s)
    job = executor.submit(local_task, str(config_path))
    write_job_record(point.run_dir, "local", str(job.job_id))
    try:
        statuses = job.results()
    except Exception as exc:  # submitit re-raises the task's failure with its traceback
        raise GptparError(f"run {point.run_dir} failed: {str(exc).strip().splitlines()[-1]}") from None
    return statuses[0]


def submit(cfg: Config, kind: str, dry_run: bool = False) -> int:
    """`gptpar submit dp|pp`: one run, on SLURM when reachable, else local processes."""
    shape(cfg, kind)
    spec = resolve(cfg, kind)
    point = new_point(cfg)
    script = script_for([point], spec, point.run_dir.name, job_dir(point.run_dir))
    if dry_run:
        print(script, end="")
        return 0
    where = cluster.choose_cluster(cfg.launch.cluster)
    if where == "slurm":
        job_id = submit_slurm([point], spec, point.run_dir.name, job_dir(point.run_dir))
        print(f"submitted {kind} job {job_id}: {point.run_dir}")
        return 0
    status = run_local(point, spec, script)
    print(f"{kind} run {status} (local processes): {point.run_dir}")
    return 0 if status in ("completed", "requeued") else 1
