"""Talk to SLURM without accounting: detect it, submit with a clean environment, read job states.

Small clusters (and the local one) run without slurmdbd, so `sacct` fails; job states come from
`scontrol show job` (which keeps finished jobs for MinJobAge seconds) and the run folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from gptpar.errors import GptparError

SCRUBBED_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SUBMITIT_")
SCRUBBED_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a submission: no variables of a surrounding job leak into the new one.

    sbatch exports the caller's environment to the job, and SBATCH_*/SLURM_* set by an outer job
    would silently change the new job's partition, task count or node list.
    """
    env = os.environ if env is None else env
    return {k: v for k, v in env.items()
            if not k.startswith(SCRUBBED_PREFIXES) and k not in SCRUBBED_KEYS}


def slurm_reachable(timeout_s: float = 5.0) -> bool:
    """True when `sinfo` answers (a controller is up and we may submit to it)."""
    if not shutil.which("sinfo"):
        return False
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                                timeout=timeout_s, env=clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and bool(result.stdout.strip())


def choose_cluster(requested: str) -> str:
    """`launch.cluster`: auto picks slurm when reachable, else local processes."""
    if requested == "local":
        return "local"
    if slurm_reachable():
        return "slurm"
    if requested == "slurm":
        raise GptparError("launch.cluster=slurm but SLURM is not reachable (sinfo failed); "
                          "start it (make cluster-up) or use launch.cluster=local")
    return "local"


def sbatch(script_path: str, cwd: str) -> str:
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


def slurm_state(job_id: str) -> str | None:
    """gptpar state of a job the controller still knows, else None."""
    info = job_info(job_id)
    if info is None:
        return None
    return SLURM_STATES.get(info.get("JobState", ""), "failed")
