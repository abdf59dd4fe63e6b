"""The submitit backend (launch.launcher=submitit): each point becomes a submitit job whose every task runs
RankTask (gptpar.launch.submitit_task), i.e. the rank entry point of every backend, `gptpar train config.yaml` in
the run folder; the points of a sweep that share a job shape become one job array.

submitit's AutoExecutor is given the cluster that gptpar.launch.backend chose (SLURM, or submitit's local
executor on this machine) and the job spec the sbatch script is rendered from: nodes, tasks per node, CPUs per
task, the time limit, partition, account (passed explicitly, so that SBATCH_ACCOUNT and the user's defaults file
apply as they do to sbatch), QOS, constraint, the profile's GPU request and setup lines, USR2 launch.signal_s
before the limit, --requeue, and launch.max_concurrent array tasks at a time (the local executor, which has no
queue, starts a sweep's points that many at a time and returns once the last of them has started).

The jobs run from a snapshot of the package taken at submission (gptpar.snapshot), first on PYTHONPATH. submitit's
pickles and logs live in the run's job/ folder (an array's in the sweep's _jobs/, where the sbatch path writes an
array's output too). Job states and cancelling go through scontrol and scancel (on the local executor: its
controller process) and the run folder, never through submitit's sacct queries, which answer UNKNOWN on clusters
without accounting; nor is submitit's helpers.clean_env used, which drops the user's SBATCH_* (gptpar's keeps them).
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import signal
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gptpar.config import LaunchConfig
from gptpar.errors import GptparError
from gptpar.launch.prepare import Point, rank_command
from gptpar.launch.profiles import JobSpec, guarded_setup, time_seconds
from gptpar.launch.slurm import SlurmBackend, check_fits, clean_env, slurm_state
from gptpar.run.names import slug
from gptpar.snapshot import take_snapshot

MAX_REQUEUES = 1000  # submitit's max_num_timeout; the sbatch path requeues at every time limit, without a bound
LOCAL_CONTROLLER = b"submitit.local._local"  # in the command line of the local executor's controller process
WAVE_POLL_S = 1.0


def executor_parameters(cluster: str, spec: JobSpec, name: str, launch: LaunchConfig) -> dict[str, Any]:
    """AutoExecutor.update_parameters' keywords for a job of `spec` on `cluster` (slurm or local)."""
    shape = {"name": slug(name, 64), "nodes": spec.nodes, "tasks_per_node": spec.tasks_per_node,
             "cpus_per_task": spec.cpus_per_task, "timeout_min": time_seconds(spec.time) // 60}  # whole: resolve
    if cluster == "local":
        if spec.nodes != 1:
            raise GptparError(f"launch.nodes={spec.nodes}: submitit's local executor runs on this one machine; use "
                              "launch.nodes=1, or SLURM (launch.cluster=slurm)")
        return {**shape, "gpus_per_node": spec.gpus_per_node}
    extra: dict[str, Any] = {"requeue": True}
    if spec.gpu_directive:  # the profile's request, as the sbatch script makes it: --gpus=TYPE:N, --gres=gpu:N, ...
        flag, _, value = spec.gpu_directive.removeprefix("--").partition("=")
        extra[flag] = value
    named = {"partition": spec.partition, "account": spec.account, "qos": spec.qos, "constraint": spec.constraint}
    return {**shape, **{f"slurm_{key}": value for key, value in named.items() if value},
            "slurm_signal_delay_s": spec.signal_s, "slurm_array_parallelism": launch.max_concurrent,
            "slurm_setup": guarded_setup(spec.setup), "slurm_additional_parameters": extra}


def python_command(cluster: str, points: Sequence[Point], code: Path) -> str:
    """The shell words that start a task's Python: launch.venv's (the rank command's), with the snapshot first on
    PYTHONPATH. On SLURM the batch script expands the PYTHONPATH the profile's setup lines leave; the local
    executor runs the words without a shell, so there it is this process's."""
    python = shlex.quote(str(Path(rank_command(points[0].cfg)[0]).with_name("python")))
    if cluster == "slurm":
        return f"env PYTHONPATH={shlex.quote(str(code))}${{PYTHONPATH:+:$PYTHONPATH}} {python}"
    path = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    return f"env PYTHONPATH={shlex.quote(path)} {python}"


def executor_text(points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> str:
    """What --dry-run prints for a submitit job: its folder, what each task runs, and the executor's parameters
    as on SLURM (the snapshot is taken at submission)."""
    params = executor_parameters("slurm", spec, name, points[0].cfg.launch)
    array = f" as one array of {len(points)}" if len(points) > 1 else ""
    lines = [f"# submitit AutoExecutor(folder={output_dir}){array}: each task runs, in its run folder, "
             f"{shlex.join(rank_command(points[0].cfg))} from a snapshot of the code taken at submission",
             *(f"{key}={value!r}" for key, value in params.items())]
    return "\n".join(lines) + "\n"


class SubmititBackend:
    """Jobs through submitit on SLURM (SubmititLocalBackend: on its local executor); their states from scontrol (or
    the local controller's process) and the run folder."""

    cluster = "slurm"  # submitit's executor
    name = "submitit"  # Backend.name (job.json)
    where = "SLURM through submitit"
    scheduler = "SLURM"

    def __init__(self) -> None:
        self.jobs: dict[str, Any] = {}  # submitit's Job of each job id submitted here (the Python API's handles)

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        """Snapshot the code, then submit one job per point (an array on SLURM); returns each point's job id."""
        import submitit  # only where jobs are submitted: `gptpar status` never loads it

        from gptpar.launch.submitit_task import RankTask

        params = executor_parameters(self.cluster, spec, name, points[0].cfg.launch)
        output_dir.mkdir(parents=True, exist_ok=True)
        code = Path(tempfile.mkdtemp(prefix="code-", dir=output_dir))
        take_snapshot(code)
        python = python_command(self.cluster, points, code)
        with self._handed_over():
            executor = submitit.AutoExecutor(folder=output_dir, cluster=self.cluster, **{
                f"{self.cluster}_python": python, f"{self.cluster}_max_num_timeout": MAX_REQUEUES})
            executor.update_parameters(**params)
            if self.cluster == "local":  # AutoExecutor does not pass it on; the local executor takes it
                executor._executor.update_parameters(signal_delay_s=spec.signal_s)
        tasks = [RankTask(str(p.folder.path), rank_command(p.cfg)) for p in points]
        wave = len(tasks) if self.cluster == "slurm" else points[0].cfg.launch.max_concurrent
        ids: list[str] = []
        for start in range(0, len(tasks), wave):
            if start:  # the local executor: the next points start once the previous ones have ended
                while not all(self.jobs[i].done() for i in ids[start - wave:]):
                    time.sleep(WAVE_POLL_S)
            with self._handed_over():
                jobs = executor.submit_array(tasks[start:start + wave])
            for point, job in zip(points[start:start + wave], jobs, strict=True):
                job_id = job.job_id if self.cluster == "slurm" else f"{socket.gethostname()}:{job.job_id}"
                point.folder.write_job_record(self.name, job_id, spec.kind)
                self.jobs[job_id] = job
                ids.append(job_id)
        return ids

    @contextlib.contextmanager
    def _handed_over(self) -> Iterator[None]:
        """Calls into submitit: with the environment a submission gets (sbatch and the local controller inherit
        this process's: no variables of a surrounding job), submitit's printing of sbatch's errors held back,
        and its errors as one line."""
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(clean_env(saved))
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                yield
        except GptparError:
            raise
        except Exception as exc:
            raise GptparError(_one_line(exc, self.where)) from None
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def check(self, spec: JobSpec) -> None:
        if self.cluster == "slurm":
            check_fits(spec)

    def state(self, job_id: str) -> str | None:
        if self.cluster == "slurm":
            return slurm_state(job_id)
        return "running" if _local_controller(job_id) else None

    def cancel(self, job_id: str) -> None:
        """scancel; on the local executor, TERM to its controller, which passes it on to the tasks and they to their
        ranks (each stops at the next step boundary)."""
        if self.cluster == "slurm":
            SlurmBackend().cancel(job_id)
        elif (pid := _local_controller(job_id)) is not None:
            os.kill(pid, signal.SIGTERM)

    def signal(self, job_id: str, signals: Sequence[signal.Signals]) -> bool:
        """scancel's signals, which each task passes on to its rank (gptpar.launch.submitit_task); not on the local
        executor, whose controller would take a SIGQUIT for an end."""
        return self.cluster == "slurm" and SlurmBackend().signal(job_id, signals)


class SubmititLocalBackend(SubmititBackend):
    """Jobs through submitit's local executor on this machine."""

    cluster = "local"
    name = "submitit-local"
    where = "submitit's local executor on this machine"
    scheduler = "submitit's local executor"


def _one_line(exc: Exception, where: str) -> str:
    """submitit's error (sbatch's stderr, a Python traceback's message) as one line."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:400] or type(exc).__name__
    if type(exc).__name__ == "FailedJobError":  # sbatch refused the job: its lines name what
        return (f"sbatch refused the submitit job: {text}; fix the launch.* key it names (partition, account, qos, "
                "constraint, gpus, time), or check the profile with `gptpar doctor`")
    return f"submitit could not submit to {where}: {type(exc).__name__}: {text}"


def _local_controller(job_id: str) -> int | None:
    """The pid of a local job's controller (job id `host:pid`) while it runs on this host, else None. A controller
    that has exited but was not reaped yet (a zombie of this process) no longer runs."""
    host, _, pid = job_id.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    proc = Path("/proc") / pid
    try:
        running = LOCAL_CONTROLLER in (proc / "cmdline").read_bytes()
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return int(pid) if running and state != "Z" else None
