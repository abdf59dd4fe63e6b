"""The shape a job takes on a cluster: the config a job kind implies (`shaped`) and the tasks, nodes and GPUs the
scheduler is asked for (`job_shape`), read alike by the launcher (its job scripts) and the planner (the layouts it
prices)."""

from __future__ import annotations

from dataclasses import dataclass

from gptpar.config import Config, ConfigError, updated
from gptpar.errors import GptparError
from gptpar.parallel.grid import grid_sizes, ranks_per_replica, world_size

KINDS = ("dp", "pp")


@dataclass(frozen=True)
class JobShape:
    """What a job asks the scheduler for: one task per rank, and the GPUs those tasks use."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int


def shaped(cfg: Config, kind: str, dp_set: bool | None = None) -> Config:
    """The config a job kind implies: `dp` fills every requested GPU with a replica (launch.gpus x
    launch.nodes ranks over the grid's other dimensions); `pp` is the one-process pipeline, or with
    parallel.pp > 1 the multi-process one, shaped like `dp` (replicas of parallel.pp stage ranks).

    A parallel.dp the user set (`dp_set`; by default: any value but 1) that the job's shape would
    change is refused rather than silently replaced."""
    if kind not in KINDS:
        raise GptparError(f"job kind {kind!r}: choose one of {', '.join(KINDS)}")
    dp_set = cfg.parallel.dp != 1 if dp_set is None else dp_set
    if kind == "pp" and cfg.parallel.pp == 1:
        if dp_set and cfg.parallel.dp != 1:
            raise ConfigError(f"parallel.dp={cfg.parallel.dp} is set, but kind pp runs one process (parallel.dp=1); "
                              "drop parallel.dp, or use kind dp")
        mode = cfg.parallel.pp_mode if cfg.parallel.pp_mode != "single" else "pipeline_parallel"
        return updated(cfg, {"parallel.dp": 1, "parallel.pp_mode": mode})
    ranks = max(cfg.launch.gpus, 1) * cfg.launch.nodes
    others = ranks_per_replica(cfg)
    if ranks % others:
        raise GptparError(f"launch.gpus x launch.nodes = {ranks} GPUs do not divide into the grid's other "
                          f"dimensions ({others} ranks per replica)")
    if dp_set and cfg.parallel.dp != ranks // others:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} is set, but kind dp sets it from the job's shape "
                          f"(launch.gpus x launch.nodes = {ranks} GPUs: parallel.dp={ranks // others}); drop "
                          "parallel.dp, or set launch.gpus / launch.nodes instead")
    return updated(cfg, {"parallel.dp": ranks // others})


def job_shape(cfg: Config) -> JobShape:
    """Tasks = ranks of the grid (one per GPU), spread evenly over the nodes; a tensor-parallel group
    stays inside a node. A one-process pipeline is one task driving every GPU of its node."""
    launch = cfg.launch
    if cfg.parallel.pp_mode != "single":
        if launch.nodes != 1:
            raise GptparError(f"launch.nodes={launch.nodes}: a one-process pipeline (parallel.pp_mode="
                              f"{cfg.parallel.pp_mode}) runs on one node")
        return JobShape(1, 1, launch.gpus)
    ranks = world_size(cfg)
    if ranks % launch.nodes:
        raise GptparError(f"the grid's {ranks} ranks do not spread evenly over launch.nodes={launch.nodes}")
    per_node = ranks // launch.nodes
    tp = grid_sizes(cfg)["tp"]
    if per_node % tp:
        raise GptparError(f"{per_node} ranks per node cannot hold whole tensor-parallel groups of {tp}")
    gpus = launch.gpus if launch.gpus == 0 else per_node
    return JobShape(launch.nodes, per_node, gpus)
