"""The launch backends behind one small interface, and the one place that chooses between them.

A backend submits the points of one job spec, reports a job's state, and cancels a job (the split
submitit makes between its core, slurm and local executors). `submit`, `sweep`, `status` and a
`gptpar train` that starts its own ranks never branch on the backend themselves. Where a job runs
(launch.cluster: SLURM or this machine) is decided first, by one rule; how it is handed over
(launch.launcher: gptpar's sbatch script, or submitit) second, by the launcher's row in gptpar/launchers.py,
whose backends and --dry-run text are loaded here by name: this module names no launcher.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any, Protocol

from gptpar.config import LaunchConfig
from gptpar.errors import GptparError
from gptpar.launch import slurm
from gptpar.launch.prepare import Point
from gptpar.launch.profiles import JobSpec
from gptpar.launchers import DEFAULT_LAUNCHER, LAUNCHERS, signal_job
from gptpar.run.folder import RunFolder
from gptpar.run.state import LIVE_JOB_STATES, job_of, last_header, resume_hint


class Backend(Protocol):
    """What a launcher's row (gptpar/launchers.py) names for each cluster, as a class made with no argument."""

    name: str  # recorded in job.json; backend_named makes the backend again from it
    where: str  # said to the user before anything runs
    scheduler: str  # who holds its jobs, as messages name it ("SLURM"); "" where the run's own processes are the job

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        """Start (or queue) one job running `points`; returns each point's job id."""

    def check(self, spec: JobSpec) -> None:
        """Refuse in one line a job shape this backend could never start (before anything is written)."""

    def state(self, job_id: str) -> str | None:
        """The scheduler's word on a job (gptpar.run.state.SCHEDULER_STATES; SLURM's pending says why: Pending),
        None when it has none."""

    def cancel(self, job_id: str) -> None: ...

    def signal(self, job_id: str, signals: Sequence[signal.Signals]) -> bool:
        """Send `signals`, in order, to every task of a live job (through gptpar.launchers.signal_job, which a rank
        asking its peers for their dumps uses too); False where they cannot be reached from here."""


def _cluster(requested: str, profile: str) -> str:
    """`launch.cluster`: local, slurm, or auto. auto takes SLURM when it answers, and local processes
    only where no SLURM client exists at all and the profile is `local`: a failing SLURM on a cluster
    must never turn into training on the login node."""
    if requested == "local":
        return "local"
    reason = slurm.unreachable_reason()
    if reason is None:
        return "slurm"
    if requested == "slurm" or shutil.which("sinfo") or profile != "local":
        fix = "start it (make cluster-up)" if profile == "local" else "check the cluster's SLURM (sinfo)"
        shown = profile if profile.isprintable() else repr(profile)
        raise GptparError(f"SLURM unreachable: {reason} (launch.cluster={requested}, launch.profile={shown}); "
                          f"{fix}, or run here with launch.cluster=local")
    return "local"


def _loaded(ref: str) -> Any:
    """The object a launcher's row names by its "module:Object" string."""
    module, _, name = ref.partition(":")
    return getattr(import_module(module), name)


def choose_backend(launch: LaunchConfig) -> Backend:
    """Where (launch.cluster, by the rule of _cluster), then how: the launch.launcher row's backend for that cluster
    (SLURM through gptpar's sbatch script or through submitit, or this machine as gptpar's local processes or
    submitit's local executor)."""
    return _loaded(LAUNCHERS[launch.launcher].backends[_cluster(launch.cluster, launch.profile)])()


def backend_named(name: str) -> Backend:
    """The backend a job record names (Backend.name); a record naming none known (schema-1 folders' empty name) ran
    as the default launcher's local processes."""
    classes = [_loaded(ref) for row in LAUNCHERS.values() for ref in row.backends.values()]
    fallback = _loaded(LAUNCHERS[DEFAULT_LAUNCHER].backends["local"])
    return next((cls for cls in classes if cls.name == name), fallback)()


def job_text(points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> str:
    """What --dry-run prints for one job: the launcher's text (the sbatch script, or submitit's parameters)."""
    return _loaded(LAUNCHERS[points[0].cfg.launch.launcher].dry_run)(points, spec, name, output_dir)


def job_state(job: tuple[str, str] | None) -> str | None:
    """What the backend of a job (as job_of names it) says of it; None without a job."""
    return backend_named(job[0]).state(job[1]) if job else None


def scheduler_state(folder: RunFolder) -> str | None:
    """What the backend that ran a folder's job says of it; None for a run without a job."""
    return job_state(job_of(folder))


def cancel_run(folder: RunFolder, job: tuple[str, str] | None = None) -> str:
    """Stop a folder's run and say what was done: cancel its job (`job`, else the folder's own) while the scheduler
    holding it (SLURM, or submitit's local executor) says it is pending or running, else interrupt the process
    holding the folder on this host (SIGINT: every rank stops at the next step boundary, checkpointed, and the run can
    be resumed). A job whose run has not started (a plain script's pending job) leaves no folder behind."""
    job = job or job_of(folder)
    backend = backend_named(job[0]) if job is not None else None
    if job is not None and backend.scheduler:
        state = backend.state(job[1])
        if state not in LIVE_JOB_STATES:
            known = state or f"no longer known to {backend.scheduler}"
            return f"nothing to cancel: {backend.scheduler} job {job[1]} is {known}"
        backend.cancel(job[1])
        if not folder.holds_run():
            return f"cancelled {backend.scheduler} job {job[1]} ({state}); its run had not started"
        folder.record_cancel(job[1])
        return f"cancelled {backend.scheduler} job {job[1]} ({state}); {_resume(folder)}"
    holder = folder.holder()
    if holder is None:
        return "nothing to cancel: no process runs it"
    if holder.get("host") != socket.gethostname():
        return f"runs on host {holder.get('host')} (pid {holder.get('pid')}); cancel it there"
    try:
        os.kill(int(holder["pid"]), signal.SIGINT)
    except ProcessLookupError:
        return "nothing to cancel: its process has just ended"
    return f"interrupted pid {holder['pid']}: its ranks stop at the next step boundary; {_resume(folder)}"


def signal_run(folder: RunFolder, signals: Sequence[signal.Signals], job: tuple[str, str] | None = None) -> bool:
    """Send `signals` to every rank of a folder's live run, as cancel_run reaches them: through the scheduler holding
    its job (`job`, else the folder's own), else through the process holding the folder on this host (the local
    launcher, which passes them on). False where neither can be reached from here."""
    job = job or job_of(folder)
    if job is not None and (backend := backend_named(job[0])).scheduler:
        return backend.signal(job[1], signals)
    holder = folder.holder()
    return holder is not None and holder.get("host") == socket.gethostname() and \
        signal_job("pid", str(holder["pid"]), signals)


def _resume(folder: RunFolder) -> str:
    """How to resume a run just cancelled, from its job record or rank 0's header."""
    return resume_hint(folder, last_header(folder).get("launcher"))
