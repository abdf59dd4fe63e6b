"""The Python API: submit runs and sweeps from a notebook, wait on them, and read their results and the report's
table as Python values.

    from gptpar import api
    job = api.submit("dp", gpus=2, overrides={"train.max_steps": 200})   # a handle on the run's job
    job.state(); job.wait(); job.result()   # result: the run's status row and final record, as a dict
    jobs = api.sweep("sweeps/dp_scaling.yaml"); api.wait(jobs)
    table = api.report("runs/dp_scaling")   # summary.csv's table, as rows or a DataFrame

Each call resolves its config as the CLI does (the user's defaults, a config file, then the overrides) and hands
it to the same backends (launch.launcher=sbatch or submitit, launch.cluster), so a run submitted here is the run
`gptpar submit` would start, and `gptpar status`, `logs`, `cancel` and `report` see it the same way. A handle's
state comes from gptpar's one state machine (the scheduler's word on the job, then the run folder).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpar.cluster.shape import KINDS
from gptpar.errors import GptparError
from gptpar.launch.backend import Backend, backend_named, cancel_run, job_of
from gptpar.launch.submit import submit_run
from gptpar.launch.sweep import submit_sweep
from gptpar.run.folder import RunFolder
from gptpar.run.rows import run_result
from gptpar.run.state import LIVE_JOB_STATES, read_run
from gptpar.user_defaults import resolve_config

Overrides = Mapping[str, Any] | Sequence[str]  # {"train.lr": 1e-3} or ["train.lr=1e-3"]
POLL_S = 2.0


def _words(overrides: Overrides) -> list[str]:
    """Overrides as the command line's `section.key=value` words (a mapping's values as their text)."""
    if isinstance(overrides, Mapping):
        return [f"{key}={value}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        raise GptparError(f"overrides: {overrides!r} is one string; give a mapping or a list of section.key=value")
    if not isinstance(overrides, Sequence) or not all(isinstance(word, str) for word in overrides):
        raise GptparError(f"overrides: {overrides!r} is not a mapping or a list of section.key=value strings; give "
                          "e.g. {'train.lr': 1e-3} or ['train.lr=1e-3']")
    return list(overrides)


@dataclass
class Job:
    """A handle on one run's job. `submitit` is submitit's Job object for a job submitted through submitit in this
    process (None otherwise): its stdout() and stderr() are the job's logs."""

    folder: RunFolder
    backend: Backend
    job_id: str  # the scheduler's id: SLURM's, or host:pid on this machine
    submitit: Any = None

    @classmethod
    def of(cls, run_dir: str | Path, backend: Backend | None = None) -> Job:
        """The handle of the job that a run folder's job record names; `backend` supplies submitit's Job objects of
        the jobs it submitted."""
        folder = RunFolder(Path(run_dir).resolve())
        job = job_of(folder)
        if job is None:
            raise GptparError(f"run {folder.path} has no job record (job/job.json); it was not submitted")
        backend = backend if backend is not None and backend.name == job[0] else backend_named(job[0])
        return cls(folder, backend, job[1], getattr(backend, "jobs", {}).get(job[1]))

    @property
    def run_dir(self) -> Path:
        return self.folder.path

    def state(self) -> str:
        """The run's state (gptpar.run.state.STATES): pending, running, completed, failed, stopped, ..."""
        return read_run(self.folder, scheduler=self.backend.state(self.job_id)).state

    def wait(self, timeout: float | None = None, poll_s: float = POLL_S) -> str:
        """Block until the run is no longer pending or running, or `timeout` seconds have passed; its state then
        (a cancelled or failed job's too)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.state()) in LIVE_JOB_STATES:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
        return state

    def result(self) -> dict[str, Any]:
        """Wait for the run, then its result: run_id, run_dir, status (the report's word; also as `state`), detail,
        job_id, step, total_steps, final_loss (the last step's global_loss), tokens_per_s (summed over replicas),
        elapsed_s and rank 0's final record. A failed run raises a one-line GptparError saying why."""
        self.wait()
        return run_result(self.folder, self.backend.state(self.job_id))

    def cancel(self) -> str:
        """Cancel the job (a running one stops at a step boundary, checkpointed); what was done, in one line."""
        return cancel_run(self.folder)

    def stdout(self) -> str | None:
        return self._log("out")

    def stderr(self) -> str | None:
        return self._log("err")

    def _log(self, suffix: str) -> str | None:
        """submitit's log of the job's first task, or the sbatch job's files in the run's job/ folder."""
        if self.submitit is not None:
            return self.submitit.stdout() if suffix == "out" else self.submitit.stderr()
        files = sorted(self.folder.job_dir.glob(f"slurm-*.{suffix}"))
        return "".join(path.read_text(errors="replace") for path in files) if files else None


def submit(kind: str = "dp", config: str | Path | None = None, *, gpus: int | None = None, nodes: int | None = None,
           overrides: Overrides = ()) -> Job:
    """Submit one run as `gptpar submit KIND [CONFIG] --gpus G --nodes N section.key=value...` does; its handle."""
    if kind not in KINDS:
        raise GptparError(f"kind {kind!r}: choose one of {', '.join(KINDS)}")
    words = _words(overrides)
    words += [f"launch.{key}={value}" for key, value in (("gpus", gpus), ("nodes", nodes)) if value is not None]
    cfg = resolve_config(config, words)[0]
    point, backend, job_id = submit_run(cfg, kind)
    return Job(point.folder, backend, job_id, getattr(backend, "jobs", {}).get(job_id))


def sweep(path: str | Path, overrides: Overrides = (), runs_dir: str | Path = "", rerun: bool = False) -> list[Job]:
    """Submit a sweep as `gptpar sweep` does (points done or queued are skipped); a handle for every point that has
    a job, in the sweep's order."""
    points, backend, _ = submit_sweep(path, str(runs_dir), _words(overrides), rerun)
    return [Job.of(p.folder.path, backend) for p in points if job_of(p.folder) is not None]


def wait(jobs: Job | Iterable[Job], timeout: float | None = None) -> list[str]:
    """Wait for every job (for at most `timeout` seconds in all); their states."""
    jobs = [jobs] if isinstance(jobs, Job) else list(jobs)
    deadline = None if timeout is None else time.monotonic() + timeout
    return [job.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) for job in jobs]


def report(runs_dir: str | Path = "runs", frame: bool | None = None, **options: Any) -> Any:
    """The report's table of every run under runs_dir (summary.csv's rows): a DataFrame where pandas is installed,
    else (or with frame=False) a list of dicts; options as analysis.load_runs takes them."""
    from analysis.load import load_runs

    return load_runs(runs_dir, frame, **options)
