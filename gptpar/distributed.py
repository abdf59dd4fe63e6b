"""Process-group setup: who am I (rank layout from torchrun, SLURM or a local spawn), which
backend and device, and a bounded timeout so a dead or hung rank fails the whole job.

The layout functions are pure (they take an env mapping and a GPU count) so every launcher's
quirks are unit-tested without a cluster.

Launcher rule: torchrun's RANK/WORLD_SIZE win. SLURM counts only inside a job *step*
(SLURM_STEP_ID set, i.e. under srun) or when the job has a single task: an sbatch batch script
also carries SLURM_PROCID=0 and SLURM_NTASKS>1, and treating it as rank 0 of N would wait
forever for N-1 ranks that nobody started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError

SPAWN_MARKER = "GPTPAR_SPAWNED"  # set by spawn_local so its ranks report launcher="spawn"
PORT_BASE, PORT_SPAN = 20000, 20000  # SLURM-derived ports stay in 20000..39999 (unprivileged)


@dataclass(frozen=True)
class Layout:
    """Where this process sits, as read from the environment (before backend/device are chosen)."""

    launcher: str  # torchrun | slurm | spawn | single
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int | None
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class RankInfo(Layout):
    """The layout plus what was chosen for it: the collective backend and this rank's device."""

    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: `gpu[001-003,007]`, `a1,b[2-3]`, `n[1-2]-ib[3-4]` (zero padding kept)."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise GptparError(f"bad SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise GptparError(f"bad SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_host(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [head + value + rest for value in _expand_range(match.group(1), pattern)
            for rest in _expand_host(tail)]


def _expand_range(body: str, pattern: str) -> list[str]:
    values: list[str] = []
    for piece in body.split(","):
        lo, sep, hi = piece.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise GptparError(f"bad SLURM node list range {piece!r} in {pattern!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise GptparError(f"bad SLURM node list range {piece!r} in {pattern!r}: end before start")
        width = len(lo)  # SLURM pads to the width of the range's start, e.g. 001-010
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def slurm_port(job_id: str | int) -> int:
    """A port that is the same on every task of a job and differs between jobs sharing a node."""
    digits = re.sub(r"\D", "", str(job_id))  # array jobs may look like 1234_5
    return PORT_BASE + int(digits or 0) % PORT_SPAN


def _tasks_per_node(env: Mapping[str, str], world_size: int) -> int:
    """SLURM_NTASKS_PER_NODE if given, else this node's entry of SLURM_TASKS_PER_NODE (`4(x2),3`)."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts: list[int] = []
    for entry in filter(None, env.get("SLURM_TASKS_PER_NODE", "").split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", entry)
        if not match:
            raise GptparError(f"cannot read SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else world_size


def is_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside `srun` (or a one-task job), where SLURM_PROCID really is this process's rank."""
    if "SLURM_PROCID" not in env:
        return False
    return "SLURM_STEP_ID" in env or int(env.get("SLURM_NTASKS", "1")) == 1


def layout_from_env(env: Mapping[str, str]) -> Layout:
    """Read the rank layout; an explicit MASTER_ADDR/MASTER_PORT always wins."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        launcher = "spawn" if env.get(SPAWN_MARKER) else "torchrun"
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", 0))
        node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else rank // local_world
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500))
        return Layout(launcher, rank, world, local_rank, local_world, node, addr, port)
    if is_slurm_step(env):
        world = int(env.get("SLURM_NTASKS", "1"))
        rank, local_rank = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        local_world = _tasks_per_node(env, world)
        node = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else None
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
        addr = env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
        port = int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0")))
        return Layout("slurm", rank, world, local_rank, local_world, node, addr, port)
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500))
    return Layout("single", 0, 1, 0, 1, 0, addr, port)


def choose_backend(requested: str, gpu_count: int) -> str:
    """`auto` means NCCL when a GPU is visible, gloo otherwise."""
    if requested == "auto":
        return "nccl" if gpu_count > 0 else "gloo"
    if requested == "nccl" and gpu_count == 0:
        raise GptparError("parallel.backend=nccl needs a visible CUDA GPU and none is; use gloo or auto")
    return requested


def choose_device(backend: str, layout: Layout, gpu_count: int) -> torch.device:
    """cuda:LOCAL_RANK when the node's GPUs are all visible; cuda:0 when SLURM bound one GPU per task.

    With one visible GPU under SLURM we trust that SLURM bound a GPU to each task (--gpus-per-task
    or --gpu-bind); CUDA_VISIBLE_DEVICES is never modified here.
    """
    if backend != "nccl":
        return torch.device("cpu")
    if gpu_count >= layout.local_world_size:
        return torch.device(f"cuda:{layout.local_rank}")
    if gpu_count == 1 and layout.launcher == "slurm":
        return torch.device("cuda:0")
    raise GptparError(
        f"{layout.local_world_size} ranks on this node need {layout.local_world_size} GPUs but only "
        f"{gpu_count} are visible; request one GPU per task (launch.gpus) or use parallel.backend=gloo")


def _nccl_env() -> None:
    """Make NCCL collectives honour the process-group timeout instead of hanging forever."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


def init_distributed(pcfg: ParallelConfig, env: Mapping[str, str] | None = None) -> RankInfo:
    """Join the process group described by the environment (a no-op group of one without a launcher)."""
    layout = layout_from_env(os.environ if env is None else env)
    gpu_count = torch.cuda.device_count()
    backend = choose_backend(pcfg.backend, gpu_count)
    device = choose_device(backend, layout, gpu_count)
    info = RankInfo(**dataclasses.asdict(layout), backend=backend, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if layout.world_size == 1 or dist.is_initialized():
        return info
    if backend == "nccl":
        _nccl_env()
    try:
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{layout.master_addr}:{layout.master_port}",
            rank=layout.rank, world_size=layout.world_size,
            timeout=timedelta(seconds=pcfg.timeout_s),
            device_id=device if device.type == "cuda" else None)
    except Exception as exc:  # rendezvous errors come as RuntimeError/DistStoreError/TimeoutError
        raise GptparError(
            f"rank {layout.rank}/{layout.world_size}: joining the process group at "
            f"{layout.master_addr}:{layout.master_port} ({backend}) failed within "
            f"parallel.timeout_s={pcfg.timeout_s:g}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    return info


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_context(pcfg: ParallelConfig) -> Iterator[RankInfo]:
    """init_distributed + destroy on the way out (normal exit or exception)."""
    info = init_distributed(pcfg)
    try:
        yield info
    finally:
        destroy_distributed()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(index: int, fn: Callable[..., Any], world_size: int, port: int,
                  pcfg: ParallelConfig, args: tuple, failures: Any) -> None:
    """Entry point of one spawned rank: torchrun-like env, process group, then fn.

    A failure is also reported with its time on `failures`: when one rank raises, its peers fail
    soon after with "connection closed", and the earliest failure is the one worth naming.
    """
    os.environ.update({
        "RANK": str(index), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(index),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        SPAWN_MARKER: "1",
    })
    try:
        info = init_distributed(pcfg)
        fn(info, *args)
    except BaseException as exc:
        failures.put((time.time(), index, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        raise
    # Only on success: destroying a group with a failed peer can block, and the process exits anyway.
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

