"""The submit side's resolution of a config, done once before anything runs: the job's shape from the
rank grid, the run folder (id, absolute runs folder, config.yaml written once) and the tokenizer.

`gptpar submit`, `gptpar sweep` and a `gptpar train` that starts its own ranks all come through
`plan_run`; the ranks then only add what the launcher tells them (gptpar.config.resolve_for_launch).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from gptpar.config import Config, grid_sizes, updated, world_size
from gptpar.data.tokenizer import resolve_tokenizer_choice
from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder, in_use, run_folder
from gptpar.run.names import derived_run_id

KINDS = ("dp", "pp")


@dataclass(frozen=True)
class Point:
    """One run to start: its resolved config and its folder."""

    cfg: Config
    folder: RunFolder


@dataclass(frozen=True)
class Shape:
    """What a job asks the scheduler for: one task per rank, and the GPUs those tasks use."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int


def shaped(cfg: Config, kind: str) -> Config:
    """The config a job kind implies: `dp` fills every requested GPU with a replica (launch.gpus x
    launch.nodes ranks over the grid's other dimensions); `pp` is the one-process pipeline."""
    if kind not in KINDS:
        raise GptparError(f"job kind {kind!r}: choose one of {', '.join(KINDS)}")
    if kind == "pp":
        mode = cfg.parallel.pp_mode if cfg.parallel.pp_mode != "single" else "pipeline_parallel"
        return updated(cfg, {"parallel.dp": 1, "parallel.pp_mode": mode})
    ranks = max(cfg.launch.gpus, 1) * cfg.launch.nodes
    others = world_size(cfg) // cfg.parallel.dp
    if ranks % others:
        raise GptparError(f"launch.gpus x launch.nodes = {ranks} GPUs do not divide into the grid's other "
                          f"dimensions ({others} ranks per replica)")
    return updated(cfg, {"parallel.dp": ranks // others})


def job_shape(cfg: Config) -> Shape:
    """Tasks = ranks of the grid (one per GPU), spread evenly over the nodes; a tensor-parallel group
    stays inside a node. A one-process pipeline is one task driving every GPU of its node."""
    launch = cfg.launch
    if cfg.parallel.pp_mode != "single":
        if launch.nodes != 1:
            raise GptparError(f"launch.nodes={launch.nodes}: a one-process pipeline (parallel.pp_mode="
                              f"{cfg.parallel.pp_mode}) runs on one node")
        return Shape(1, 1, launch.gpus)
    ranks = world_size(cfg)
    if ranks % launch.nodes:
        raise GptparError(f"the grid's {ranks} ranks do not spread evenly over launch.nodes={launch.nodes}")
    per_node = ranks // launch.nodes
    tp = grid_sizes(cfg)["tp"]
    if per_node % tp:
        raise GptparError(f"{per_node} ranks per node cannot hold whole tensor-parallel groups of {tp}")
    gpus = launch.gpus if launch.gpus == 0 else per_node
    return Shape(launch.nodes, per_node, gpus)


def plan_run(cfg: Config, kind: str | None = None, runs_dir: str | Path | None = None, run_id: str = "",
             write: bool = True) -> Point:
    """Resolve the submit side: job kind, absolute runs folder, run id (explicit, or derived once
    here), concrete tokenizer; then write config.yaml (unless `write` is False, as for --dry-run).
    A folder that is live or holds a different config is refused, never renamed."""
    if kind is not None:
        cfg = shaped(cfg, kind)
    root = Path(runs_dir or cfg.log.runs_dir).resolve()
    name = run_id or cfg.log.run_id or derived_run_id(cfg.log.name)
    folder = run_folder(root, name, "log.run_id" if not run_id else "sweep point")
    cfg = updated(cfg, {"log.runs_dir": str(root), "log.run_id": folder.name,
                        "data.tokenizer": resolve_tokenizer_choice(cfg.data)})
    if write:
        holder = folder.holder()
        if holder is not None:
            raise GptparError(in_use(folder.path, holder))
        folder.write_config(cfg)
    return Point(cfg, folder)



def rank_command(cfg: Config) -> list[str]:
    """What every rank runs, in its run folder, on every backend: the SLURM script's srun line and the
    local launcher run exactly this, so the two paths cannot drift. The venv is launch.venv's, else
    the one of the interpreter running now (this checkout's)."""
    venv = cfg.launch.venv or sys.prefix
    return [str(Path(venv) / "bin" / "gptpar"), "train", "config.yaml"]
