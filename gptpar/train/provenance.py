"""What a log header records about where and with what a rank ran, so a number can be traced back."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from gptpar.config import Config, config_digest
from gptpar.parallel.dims import ParallelDims
from gptpar.run.logfile import SCHEMA_VERSION
from gptpar.snapshot import running_snapshot
from gptpar.train.precision import resolve_precision

SLURM_FIELDS = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID",
                "array_task_id": "SLURM_ARRAY_TASK_ID", "job_nodelist": "SLURM_JOB_NODELIST",
                "node": "SLURMD_NODENAME", "node_id": "SLURM_NODEID", "restart_count": "SLURM_RESTART_COUNT",
                "job_name": "SLURM_JOB_NAME", "partition": "SLURM_JOB_PARTITION"}


def git_commit() -> str:
    """The commit of the code running: a snapshot's own record (git would answer for whatever checkout holds it)."""
    snapshot = running_snapshot()
    if snapshot is not None:
        return snapshot["commit"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def slurm_fields() -> dict[str, str]:
    return {key: os.environ[var] for key, var in SLURM_FIELDS.items() if var in os.environ}


def job_id() -> str:
    """The scheduler's id of this job ("" outside SLURM), recorded by the run lock."""
    fields = slurm_fields()
    return fields.get("job_id", "")


def header_fields(cfg: Config, dims: ParallelDims, restart: int) -> dict[str, Any]:
    """The fields of a segment's header that are known before data and model exist (the precision as this rank's
    device resolves train.precision=auto)."""
    snapshot = running_snapshot()
    return dict(
        schema_version=SCHEMA_VERSION, run_id=cfg.log.run_id, config=cfg.to_dict(), config_digest=config_digest(cfg),
        rank=dims.rank, world_size=dims.world_size, coords=dict(dims.coords), sizes=dict(dims.sizes),
        restart=restart, host=socket.gethostname(), device=str(dims.device),
        device_name=torch.cuda.get_device_name(dims.device) if dims.device.type == "cuda" else "cpu",
        torch_version=torch.__version__, transformers_version=transformers.__version__, git_commit=git_commit(),
        slurm=slurm_fields(), start_time=time.time(), launcher=dims.launcher,
        precision=resolve_precision(cfg.train.precision, dims.device),
        activation_checkpointing=cfg.train.activation_checkpointing,
        **({"code_snapshot": {k: snapshot[k] for k in ("path", "commit", "dirty")}} if snapshot else {}))
