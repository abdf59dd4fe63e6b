"""The SLURM backend: detect SLURM, sbatch the rendered script with a clean environment, read job states
(without accounting) and cancel jobs.

Small clusters (and the local one) run without slurmdbd, so `sacct` fails; job states come from
`scontrol show job` (which keeps finished jobs for MinJobAge seconds), then from the run folder
(gptpar.run.state). submitit's `helpers.clean_env` is not used: it also drops the SBATCH_* variables
a user set on purpose (SBATCH_ACCOUNT, say), which gptpar keeps.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gptpar.errors import GptparError
from gptpar.launch.prepare import Point
from gptpar.launch.profiles import JobSpec
from gptpar.launch.render import render_script
from gptpar.launchers import signal_job
from gptpar.run.state import NEVER_STARTS, Pending

SCRUBBED_PREFIXES = ("SLURM_", "SALLOC_", "SRUN_")
SCRUBBED_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a submission: no variables of a surrounding job leak into the new one.

    sbatch exports the caller's environment to the job, and SLURM_* set by an outer job would
    silently change the new job's task count or node list. SBATCH_* are the user's own defaults
    for sbatch (an account, a partition) and are kept.
    """
    env = os.environ if env is None else env
    return {k: v for k, v in env.items()
            if not k.startswith(SCRUBBED_PREFIXES) and k not in SCRUBBED_KEYS}


def unreachable_reason(timeout_s: float = 5.0) -> str | None:
    """None when `sinfo` answers (a controller is up and we may submit to it), else why not."""
    if not shutil.which("sinfo"):
        return "no SLURM client (sinfo) on PATH"
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                                timeout=timeout_s, env=clean_env())
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer within {timeout_s:g} s"
    except OSError as exc:
        return f"sinfo could not run ({exc.strerror})"
    if result.returncode != 0 or not result.stdout.strip():
        return (result.stderr.strip().splitlines() or ["sinfo lists no partition"])[-1]
    return None


def slurm_reachable() -> bool:
    return unreachable_reason() is None


GPUS_IN_GRES = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")  # gpu:2, gpu:v100-32:2(S:0-1)


def node_limits(partition: str) -> tuple[str, int, int, int] | None:
    """(partition, most CPUs on one of its nodes, most GPUs on one, its node count) as sinfo reports them (the default
    partition where `partition` is empty); None where sinfo cannot say."""
    try:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%P|%c|%G"], capture_output=True, text=True, timeout=10,
                                env=clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [line.split("|") for line in result.stdout.splitlines() if line.count("|") == 2]
    if result.returncode != 0 or not rows:
        return None
    name = partition or next((p.rstrip("*") for p, _, _ in rows if p.endswith("*")), "")
    nodes = [(int(cpus), sum(int(n) for n in GPUS_IN_GRES.findall(gres))) for p, cpus, gres in rows
             if p.rstrip("*") == name and cpus.isdigit()]
    if not nodes:
        return None
    return name, max(c for c, _ in nodes), max(g for _, g in nodes), len(nodes)


def check_fits(spec: JobSpec) -> None:
    """Refuse, before it is queued, a job shape no node of its partition can hold (SLURM would keep it pending for
    ever, Reason=PartitionConfig); silent where sinfo cannot say."""
    limits = node_limits(spec.partition)
    if limits is None:
        return
    name, cpus, gpus, nodes = limits
    fix = "or use another launch.partition (or launch.profile)"
    asked = spec.tasks_per_node * spec.cpus_per_task
    if asked > cpus:
        raise GptparError(f"the job asks for {asked} CPUs per node ({spec.tasks_per_node} task(s) x "
                          f"launch.cpus_per_task={spec.cpus_per_task}) but partition {name}'s nodes have at most "
                          f"{cpus} (sinfo): it would never start; lower launch.cpus_per_task, {fix}")
    if spec.gpus_per_node > gpus:
        raise GptparError(f"the job asks for {spec.gpus_per_node} GPU(s) per node but partition {name}'s nodes have "
                          f"at most {gpus} (sinfo): it would never start; lower --gpus or raise --nodes, {fix}")
    if spec.nodes > nodes:
        raise GptparError(f"the job asks for {spec.nodes} node(s) but partition {name} has {nodes} (sinfo): it would "
                          f"never start; lower --nodes, {fix}")


def sbatch(script_path: str | Path, cwd: str | Path) -> str:
    """Submit a script; returns the job id. The caller's SLURM variables are scrubbed."""
    result = subprocess.run(["sbatch", "--parsable", script_path], capture_output=True, text=True,
                            cwd=cwd, env=clean_env())
    if result.returncode != 0:
        raise GptparError(f"sbatch {script_path} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip().split(";")[0]


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` output (one line of Key=Value pairs) as a dict."""
    fields: dict[str, str] = {}
    for match in re.finditer(r"(\w[\w/:]*)=(\S*)", text):
        fields.setdefault(match.group(1), match.group(2))
    return fields


def job_info(job_id: str) -> dict[str, str] | None:
    """The controller's record of a job, or None once it has forgotten the job (or has gone)."""
    try:
        result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                                text=True, timeout=10, env=clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return parse_scontrol(result.stdout.strip().splitlines()[0])


# SLURM job states (squeue/scontrol names) -> gptpar states.
SLURM_STATES = {
    "PENDING": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending", "REQUEUE_FED": "pending",
    "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running", "SUSPENDED": "running",
    "RESIZING": "running", "STAGE_OUT": "running", "SIGNALING": "running", "STOPPED": "running",
    "COMPLETED": "completed",
    "TIMEOUT": "timeout", "DEADLINE": "timeout",
    "OUT_OF_MEMORY": "oom",
    "FAILED": "failed", "CANCELLED": "failed", "NODE_FAIL": "failed", "BOOT_FAIL": "failed",
    "PREEMPTED": "failed", "REVOKED": "failed", "SPECIAL_EXIT": "failed",
}


# SLURM's pending reasons that waiting never clears, with what does ({job}: the job id; the other fields name the
# options of the job's shape as its submitter gives them: LAUNCH_KEYS, or sbatch's own for the plain scripts).
NEVER_CLEARS = {
    "PartitionConfig": "the job asks for more than the partition's nodes or limits allow (CPUs, GPUs, memory, nodes "
                       "or time); lower {gpus}, {nodes}, {cpus} or {time}, or use another partition",
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows; lower {nodes}",
    "PartitionTimeLimit": "{time} is above the partition's time limit; lower it",
    "BadConstraints": "no node has what the job asks for ({constraint}, the GPU type or count); compare with "
                      "sinfo -o '%N %c %G %f'",
    "ReqNodeNotAvail": "a node the job needs is down, drained or reserved; ask the cluster's staff, or cancel it",
    "InvalidAccount": "the account is not one of yours; fix {account}",
    "InvalidQOS": "the QOS is not one the account may use; fix {qos}",
    "JobHeldUser": "it is held; release it with: scontrol release {job}",
    "JobHeldAdmin": "an administrator holds it; ask the cluster's staff",
    "DependencyNeverSatisfied": "a job it depends on failed; cancel it",
}
LAUNCH_KEYS = {"gpus": "--gpus", "nodes": "--nodes", "cpus": "launch.cpus_per_task", "time": "launch.time",
               "constraint": "launch.constraint", "account": "launch.account", "qos": "launch.qos"}
# A plain script's job (jobs/dp.sbatch) is shaped by its #SBATCH lines, which sbatch's options override.
SBATCH_OPTIONS = {"gpus": "sbatch --gpus=TYPE:N", "nodes": "sbatch --nodes=N", "cpus": "sbatch --cpus-per-task=N",
                  "time": "sbatch --time=HH:MM:SS", "constraint": "sbatch --constraint", "account": "sbatch -A ACCOUNT",
                  "qos": "sbatch --qos=QOS"}


def pending_why(reason: str, job_id: str, keys: Mapping[str, str] = LAUNCH_KEYS) -> str:
    """A pending job's reason as the user reads it: NEVER_STARTS with the fix where waiting cannot clear it (the
    reasons above, and a QOS's or association's per-job limit), else what it waits for. `keys` names the options that
    shape the job as its submitter gives them."""
    fix = NEVER_CLEARS.get(reason)
    if fix is None and reason.startswith(("QOSMax", "AssocMax")) and "PerJob" in reason:
        fix = "the job asks for more than its QOS or account allows one job; ask for less, or another {qos}"
    if fix is not None:
        return f"{NEVER_STARTS}: {reason}; {fix.format(job=job_id, **keys)}"
    return "queued" if reason in ("", "None") else f"queued: {reason}"


def slurm_state(job_id: str) -> str | None:
    """gptpar state of a job the controller still knows (pending with its reason: Pending), else None."""
    info = job_info(job_id)
    if info is None:
        return None
    state = SLURM_STATES.get(info.get("JobState", ""), "failed")
    return Pending(pending_why(info.get("Reason", ""), job_id)) if state == "pending" else state


# The --job-name of jobs/<kind>.sbatch: SLURM knows a plain-sbatch job by it before the script has made its folder.
PLAIN_SCRIPTS = {"gptpar-dp": "dp", "gptpar-pp": "pp"}
QUEUE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class PlainJob:
    """A live job of jobs/dp.sbatch or jobs/pp.sbatch as SLURM shows it: the run folder it writes (the one its
    argument names, which it continues, else its own new one), and its state (pending with why: Pending)."""

    job_id: str
    run: Path
    state: str


def plain_job(line: str) -> PlainJob | None:
    """One line of squeue's `%i|%j|%r|%Z|%T|%o` as a plain script's job (None for another job, or an array's pending
    tasks, which have no folder name yet). The run is the script's argument (its command, %o, after the script's
    path), relative to the folder it was sbatch-ed from, else runs/<kind>-<job id> there (a RUNS or RUN given in the
    environment is SLURM's secret)."""
    job_id, name, reason, workdir, state, command = (line.split("|", 5) + [""] * 5)[:6]
    if not (job_id.isdigit() and name in PLAIN_SCRIPTS and workdir):
        return None
    argument = command.partition(" ")[2].strip()
    run = Path(workdir) / (argument or f"runs/{PLAIN_SCRIPTS[name]}-{job_id}")
    ours = SLURM_STATES.get(state, "failed")
    if ours not in ("pending", "running"):
        return None
    why = pending_why(reason, job_id, SBATCH_OPTIONS) + (f"; it continues {argument}" if argument else "")
    return PlainJob(job_id, run, Pending(why) if ours == "pending" else ours)


def plain_jobs() -> list[PlainJob]:
    """This user's live jobs of jobs/dp.sbatch and jobs/pp.sbatch: until such a job's trainer writes its folder's
    config (a minute after it starts), only SLURM knows it. [] where squeue cannot say within QUEUE_TIMEOUT_S (a
    controller answers in milliseconds, a client whose controller is down only after 9 s, which every `gptpar status`
    would wait for)."""
    if not shutil.which("squeue"):
        return []
    try:
        result = subprocess.run(["squeue", "--me", "-h", "-t", "PENDING,RUNNING", "-n", ",".join(PLAIN_SCRIPTS),
                                 "-o", "%i|%j|%r|%Z|%T|%o"], capture_output=True, text=True,
                                timeout=QUEUE_TIMEOUT_S, env=clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return [job for line in result.stdout.splitlines() if (job := plain_job(line)) is not None]


class SlurmBackend:
    """Jobs through sbatch: one job per shape, an array when several points share it."""

    name = "slurm"
    where = scheduler = "SLURM"

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        """Write each point's job folder and the script, sbatch it; returns each point's job id."""
        script = render_script(points, spec, name, output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        for point in points:
            point.folder.job_dir.mkdir(parents=True, exist_ok=True)
            (point.folder.job_dir / "submit.sbatch").write_text(script)
        job_id = sbatch(points[0].folder.job_dir / "submit.sbatch", cwd=Path.cwd())
        ids = [f"{job_id}_{index}" if len(points) > 1 else job_id for index in range(len(points))]
        for point, point_id in zip(points, ids, strict=True):
            point.folder.write_job_record(self.name, point_id, spec.kind)
        return ids

    def check(self, spec: JobSpec) -> None:
        check_fits(spec)

    def state(self, job_id: str) -> str | None:
        return slurm_state(job_id)

    def cancel(self, job_id: str) -> None:
        result = subprocess.run(["scancel", job_id], capture_output=True, text=True, env=clean_env())
        if result.returncode != 0:
            raise GptparError(f"scancel {job_id} failed: {result.stderr.strip()}")

    def signal(self, job_id: str, signals: Sequence[signal.Signals]) -> bool:
        return signal_job("slurm", job_id, signals)
