"""Run a Python function on W fresh local processes joined into one gloo/NCCL group.

The equality tests and benchmarks use this to run a function, not a training job: jobs are started
by `gptpar train` through the local launcher (gptpar.launch.local), which runs the same command a
SLURM job runs. Like torch.multiprocessing.spawn, plus a process group and the rank that failed first.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError
from gptpar.parallel.env import LAUNCHER_MARKER, free_port
from gptpar.parallel.process_group import destroy_distributed, init_distributed


def _spawned_rank(index: int, fn: Callable[..., Any], world_size: int, port: int,
                  pcfg: ParallelConfig, args: tuple, failures: Any) -> None:
    """Entry point of one spawned rank: torchrun-like env, process group, then fn.

    A failure is also reported with its time on `failures`: when one rank raises, its peers fail
    soon after with "connection closed", and the earliest failure is the one worth naming.
    """
    os.environ.update({
        "RANK": str(index), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(index),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        LAUNCHER_MARKER: "spawn",
    })
    try:
        info = init_distributed(pcfg)
        fn(info, *args)
    except BaseException as exc:
        failures.put((time.time(), index, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        raise
    # Only on success: destroying a group with a failed peer can block, and the process exits anyway.
    # The barrier first: a rank that tears its group down while its peer still does so can abort in gloo
    # ("terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
    destroy_distributed()


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any,
                pcfg: ParallelConfig | None = None) -> None:
    """Run fn(rank_info, *args) in world_size fresh processes joined into one process group.

    fn must be importable (a module-level function). When any rank raises or dies, the others are
    terminated and a GptparError naming that rank and its exception is raised here.
    """
    pcfg = pcfg or ParallelConfig(dp=world_size)
    failures = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_spawned_rank, args=(fn, world_size, free_port(), pcfg, args, failures),
                                 nprocs=world_size, join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as exc:
        reported = [(math.inf, exc.error_index, str(exc).strip().splitlines()[-1])]
        while not failures.empty():
            reported.append(failures.get())
        _, rank, message = min(reported)
        raise GptparError(f"rank {rank} failed: {message}") from None
    except mp.ProcessExitedException as exc:
        raise GptparError(f"rank {exc.error_index} died: {exc}") from None

