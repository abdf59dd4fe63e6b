"""The launch backends behind one small interface, and the one place that chooses between them.

A backend submits the points of one job spec, reports a job's state, and cancels a job (the split
submitit makes between its core, slurm and local executors). `submit`, `sweep`, `status` and a
`gptpar train` that starts its own ranks never branch on the backend themselves.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from gptpar.errors import GptparError
from gptpar.launch import slurm
from gptpar.launch.local import LocalBackend
from gptpar.launch.plan import Point
from gptpar.launch.profiles import JobSpec
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import CorruptLog, read_rank_log


class Backend(Protocol):
    name: str
    where: str  # said to the user before anything runs

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        """Start (or queue) one job running `points`; returns each point's job id."""

    def state(self, job_id: str) -> str | None:
        """The scheduler's word on a job (gptpar.run.state.SCHEDULER_STATES), None when it has none."""

    def cancel(self, job_id: str) -> None: ...


def choose_backend(requested: str, profile: str) -> Backend:
    """`launch.cluster`: local, slurm, or auto. auto takes SLURM when it answers, and local processes
    only where no SLURM client exists at all and the profile is `local`: a failing SLURM on a cluster
    must never turn into training on the login node."""
    if requested == "local":
        return LocalBackend()
    reason = slurm.unreachable_reason()
    if reason is None:
        return slurm.SlurmBackend()
    if requested == "slurm" or shutil.which("sinfo") or profile != "local":
        fix = "start it (make cluster-up)" if profile == "local" else "check the cluster's SLURM (sinfo)"
        shown = profile if profile.isprintable() else repr(profile)
        raise GptparError(f"SLURM unreachable: {reason} (launch.cluster={requested}, launch.profile={shown}); "
                          f"{fix}, or run here with launch.cluster=local")
    return LocalBackend()


def backend_named(name: str) -> Backend:
    return slurm.SlurmBackend() if name == "slurm" else LocalBackend()


def scheduler_state(folder: RunFolder) -> str | None:
    """What the backend that ran a folder's job says of it: from job.json, else (a script sbatch-ed by
    hand, like jobs/dp.sbatch) from the SLURM job id in rank 0's header; None for a run without a job."""
    record = folder.read_job_record()
    if not record.get("job_id") and folder.rank_log(0).is_file():
        try:
            headers = read_rank_log(folder.rank_log(0)).headers
        except CorruptLog:
            headers = []
        job = headers[-1].get("slurm", {}).get("job_id") if headers else None
        record = {"backend": "slurm", "job_id": str(job)} if job else {}
    if not record.get("job_id"):
        return None
    return backend_named(record.get("backend", "")).state(record["job_id"])
