"""The one registry of launchers, importable without torch: each row names a way a job is handed over
(launch.launcher), the code that does it as "module:Object" strings that gptpar.launch.backend loads by name (its
Backend on each cluster launch.cluster may choose, and what --dry-run prints), and what the rest of gptpar needs of
it without importing it: the config's choices and help, whether its time limit takes whole minutes (the job spec,
gptpar.launch.profiles), and the variables it sets in the tasks it starts (the rank side: gptpar.parallel.env reads
a rank's place from them, gptpar.train.preemption leaves the requeue to the launcher's own task).

Every task of a job is signalled here alone (`signal_job`): a rank asking its peers for their dumps when it fails in a
collective (gptpar.train.entry) and `gptpar debug` asking a live run's ranks (gptpar.launch.backend) both come here.

A new launcher: its row here and its backend module under gptpar/launch/ (docs/architecture.md's worked example).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CLUSTERS = ("slurm", "local")  # where a job runs (launch.cluster, resolved): every launcher has a backend for each


@dataclass(frozen=True)
class TaskVars:
    """Where a task that a launcher starts itself on this machine (no srun, no torchrun) finds its place: the names
    of the variables holding its job's id (the rendezvous port derives from it), the task and node counts, and the
    task's global and local rank."""

    job_id: str
    num_tasks: str
    num_nodes: str
    global_rank: str
    local_rank: str


@dataclass(frozen=True)
class LauncherRow:
    """One launcher: `name` is launch.launcher's value and the `launcher` its ranks report where it marks them."""

    name: str
    help: str  # launch.launcher's help text for it
    backends: Mapping[str, str]  # each of CLUSTERS -> "module:Class" of its Backend (gptpar.launch.backend), made bare
    dry_run: str  # "module:function" (points, spec, name, output_dir) -> the text --dry-run prints for one job
    whole_minutes: bool = False  # its time limit takes whole minutes: a launch.time with seconds is refused
    marker: str = ""  # a variable it sets in every task it starts: its ranks report it, and its own task requeues
    local_tasks: TaskVars | None = None  # its tasks' places on this machine, where no srun gives SLURM's


ROWS = (
    LauncherRow("sbatch", "gptpar's templated script",
                {"slurm": "gptpar.launch.slurm:SlurmBackend", "local": "gptpar.launch.local:LocalBackend"},
                "gptpar.launch.render:render_script"),
    LauncherRow("submitit", "a Python callable through submitit, run from a snapshot of the code; SLURM or "
                "submitit's local executor, as launch.cluster decides",
                {"slurm": "gptpar.launch.submitit_backend:SubmititBackend",
                 "local": "gptpar.launch.submitit_backend:SubmititLocalBackend"},
                "gptpar.launch.submitit_backend:executor_text", whole_minutes=True,
                marker="SUBMITIT_EXECUTOR",  # "slurm", or "local" on its local executor
                local_tasks=TaskVars("SUBMITIT_LOCAL_JOB_ID", "SUBMITIT_LOCAL_NTASKS", "SUBMITIT_LOCAL_JOB_NUM_NODES",
                                     "SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID")),
)
LAUNCHERS: dict[str, LauncherRow] = {row.name: row for row in ROWS}
DEFAULT_LAUNCHER = ROWS[0].name  # launch.launcher's default, and the backend of a job record naming none


def started_by(env: Mapping[str, str]) -> LauncherRow | None:
    """The launcher whose marker a task's environment carries; None for one no marking launcher started."""
    return next((row for row in LAUNCHERS.values() if row.marker and env.get(row.marker)), None)


SCANCEL_TIMEOUT_S = 30.0  # scancel waits for slurmctld: a hang guard, never reached when SLURM answers


def signal_job(via: str, target: str, signals: Sequence[signal.Signals]) -> bool:
    """Send `signals`, in order, to every task of a job: via "pid", to the local launcher of pid `target`, which passes
    each on to its ranks (SIGCONT only to a stopped one); via "slurm", with scancel to every task of every step of
    SLURM job `target`, every process of each step, a submitit task's rank included (not the batch shell, which a
    SIGQUIT would end). Whether every signal was delivered (False: the launcher or the job is gone)."""
    for sig in signals:
        if via == "pid":
            try:
                os.kill(int(target), sig)
            except ProcessLookupError:
                return False
        else:
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no job's own defaults
            names = " ".join(s.name.removeprefix("SIG") for s in signals)
            try:  # scancel ignoring them: a rank's scancel is a process of the job's step, which they all reach
                done = subprocess.run(["sh", "-c", f'trap "" {names}; exec scancel "$@"', "scancel",
                                       f"--signal={sig.name.removeprefix('SIG')}", target], env=env,
                                      capture_output=True, timeout=SCANCEL_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):  # no scancel here, or no answer from SLURM
                return False
            if done.returncode != 0:
                return False
    return True
