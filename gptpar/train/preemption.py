"""Checkpoint-and-requeue on a SLURM warning signal, cooperatively at a step boundary.

Jobs ask SLURM for SIGUSR2 shortly before their time limit (`--signal=USR2@N`; USR1 belongs to
NCCL). A signal handler must not checkpoint by itself (it may fire mid all-reduce), so it only
sets a flag; the trainer polls `preemption_requested()` after each step, agrees across ranks,
saves, logs a final "requeued" record and calls `requeue_current_job()` on rank 0.

`scontrol requeue` reruns the job's script, i.e. `gptpar train config.yaml` in the same run folder,
which resumes from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType

_requested = threading.Event()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _requested.set()


def install_preemption_handler(signum: int = signal.SIGUSR2) -> None:
    """Make `signum` (USR2) request a graceful stop instead of killing the process.

    The CLI installs it before the slow imports and the trainer again (replacing any other
    handler); a second install keeps a request that arrived in between.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signum) is _on_signal:
        return
    _requested.clear()
    signal.signal(signum, _on_signal)


def preemption_requested() -> bool:
    return _requested.is_set()


def _is_rank_zero(env: os._Environ[str] | dict[str, str]) -> bool:
    return env.get("RANK", env.get("SLURM_PROCID", "0")) == "0"


def requeue_current_job() -> bool:
    """Requeue this SLURM job (rank 0 only); False outside SLURM or on other ranks.

    The job must have been submitted with `--requeue`. SLURM kills the running job and starts it
    again (SLURM_RESTART_COUNT + 1) in the same run folder, where the trainer resumes.
    """
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id or not _is_rank_zero(env):
        return False
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"gptpar: scontrol requeue {job_id} failed: {result.stderr.strip()}", file=sys.stderr)
        return False
    return True
