"""Joining the job's process group: which backend and device this rank uses, and a bounded timeout
so a dead or hung rank fails the whole job instead of hanging it.

Created once per rank (`init_distributed`) and destroyed once (`destroy_distributed`), by whoever
starts the rank: the trainer's entry point, or `spawn_local` for functions in tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as distributed_c10d
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError
from gptpar.parallel.env import Layout, layout_from_env
from gptpar.strategies.data_parallel import DP_STRATEGIES


@dataclass(frozen=True)
class RankInfo(Layout):
    """The layout plus what was chosen for it: the collective backend and this rank's device."""

    backend: str
    device: torch.device


def choose_backend(requested: str, gpu_count: int) -> str:
    """`auto` means NCCL when a GPU is visible, gloo otherwise."""
    if requested == "auto":
        return "nccl" if gpu_count > 0 else "gloo"
    if requested == "nccl" and gpu_count == 0:
        raise GptparError("parallel.backend=nccl needs a visible CUDA GPU and none is; use gloo or auto")
    return requested


def group_backend(backend: str, offload: str) -> str:
    """What the process group is made with: `backend`, and beside NCCL a gloo backend for CPU tensors where
    parallel.offload=params keeps fsdp2's shards on the host (torch's clip reduces their DTensor norm there; torchtitan
    joins the same way for its CPU offload)."""
    return f"cuda:{backend},cpu:gloo" if backend == "nccl" and offload == "params" else backend


def needs_group(world_size: int, pcfg: ParallelConfig) -> bool:
    """A rank joins a process group when it has peers, or alone where its data-parallel sync needs a group of one
    (DataParallelStrategy.group_of_one)."""
    return world_size > 1 or DP_STRATEGIES[pcfg.dp_sync].group_of_one(pcfg.offload)


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


NCCL_TRACE_ENTRIES = 2000  # events in torch's NCCL flight recorder (its own default size where it is on)


def nccl_env(trace_prefix: Path | None) -> dict[str, str]:
    """What NCCL's process group reads from the environment, set before it is made: collectives honour the
    timeout instead of hanging forever; torch's own flight recorder keeps the last NCCL calls and dumps them on a
    timeout to `trace_prefix`<rank> (the run folder's, RunFolder.nccl_trace_prefix; None: torch's default in /tmp),
    which `python -m torch.distributed.flight_recorder.fr_trace` reads. Each under its torch 2.13 name and its
    older one."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_FR_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES), "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES)}
    if trace_prefix is not None:
        env["TORCH_FR_DUMP_TEMP_FILE"] = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(trace_prefix)
    return env


_world_timeout: list[timedelta] = []  # the timeout init_distributed gave the world group, for the subgroups below


def _subgroup_timeout() -> timedelta | None:
    """The world group's timeout for a group made after it (None: torch's default, where init_distributed did not
    make the world group)."""
    return _world_timeout[-1] if _world_timeout else None


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """dist.new_group with the world group's timeout: torch gives a new group its backend's default (30 minutes on
    gloo), not the world's, so a rank stopped in a subgroup's collective would hold the job for half an hour
    (device-mesh groups inherit the world's; these do not). Every rank must call it for every group, in one order."""
    return dist.new_group(ranks, timeout=_subgroup_timeout())


def subgroup(groups: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of an enumeration of disjoint groups (dist.new_subgroups_by_enumeration), with the world
    group's timeout (see new_group)."""
    return dist.new_subgroups_by_enumeration(groups, timeout=_subgroup_timeout())[0]


@contextlib.contextmanager
def library_groups_take_the_worlds_timeout() -> Iterator[None]:
    """While it runs, a group a library makes with torch's default timeout (DeepSpeed's copy of the world, its hpZ
    node groups: dist.new_group(ranks) with no timeout) gets the world group's instead, as new_group gives ours: with
    torch's default (30 minutes on gloo, 10 on NCCL) a rank stopped in one of DeepSpeed's collectives held the job that
    long. torch reads these two defaults when it makes a group, so they are set for the call and put back."""
    timeout = _subgroup_timeout()
    if timeout is None:
        yield
        return
    saved = distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    try:
        yield
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = saved


def init_distributed(pcfg: ParallelConfig, env: Mapping[str, str] | None = None,
                     nccl_trace_prefix: Path | None = None) -> RankInfo:
    """Join the process group described by the environment (without a launcher: a world of one over an in-memory
    store where `needs_group` asks for one, else none). On NCCL, `nccl_env(nccl_trace_prefix)` joins this process's
    environment first (what the user set wins)."""
    layout = layout_from_env(os.environ if env is None else env)
    gpu_count = torch.cuda.device_count()
    backend = choose_backend(pcfg.backend, gpu_count)
    device = choose_device(backend, layout, gpu_count)
    info = RankInfo(**dataclasses.asdict(layout), backend=backend, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not needs_group(layout.world_size, pcfg) or dist.is_initialized():
        return info
    if backend == "nccl":
        for key, value in nccl_env(nccl_trace_prefix).items():
            os.environ.setdefault(key, value)
    meet = ({"init_method": f"tcp://{layout.master_addr}:{layout.master_port}"} if layout.world_size > 1
            else {"store": dist.HashStore()})  # alone: nobody to meet
    _world_timeout[:] = [timedelta(seconds=pcfg.timeout_s)]
    try:
        dist.init_process_group(
            backend=group_backend(backend, pcfg.offload), **meet,
            rank=layout.rank, world_size=layout.world_size,
            timeout=_world_timeout[0],
            device_id=device if device.type == "cuda" else None)
    except Exception as exc:  # rendezvous errors come as RuntimeError/DistStoreError/TimeoutError
        raise GptparError(
            f"rank {layout.rank}/{layout.world_size}: joining the process group at "
            f"{layout.master_addr}:{layout.master_port} ({backend}) failed within "
            f"parallel.timeout_s={pcfg.timeout_s:g}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    return info


def destroy_distributed() -> None:
    """Leave the group, and forget the meshes DTensor's sharding propagation cached (this thread's caches) in it.

    That cache is keyed by meshes that compare by ranks, not by group, and returns the output specs of the first
    equal mesh it saw; a mesh finds its groups by name when it communicates, and a new world reuses the names from
    "1" on. Kept, a later world's `init_device_mesh` got DTensors whose collectives ran on an old name, by then a
    group of one rank: in the shared test ranks, after an fsdp2 run under cp=2 (its mesh over the dp x cp group,
    `ParallelDims.replica_mesh`), a left world and a new grid, test_tp_torch's all-gathers gave rank 0 its own
    shard (torch's bare "Expected cond to be True" in Shard._maybe_unpad_tensor)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()
