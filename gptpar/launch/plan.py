"""The submit side's resolution of a config, done once before anything runs: the job's shape from the
rank grid, the run folder (id, absolute runs folder, config.yaml written once) and the tokenizer.

`gptpar submit`, `gptpar sweep` and a `gptpar train` that starts its own ranks all come through
`plan_run`; the ranks then only check it against what the launcher started (gptpar.parallel.grid.launched_config).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gptpar.config import Config, ConfigError, updated
from gptpar.data.tokenizer import resolve_tokenizer_choice
from gptpar.errors import GptparError
from gptpar.parallel.grid import grid_sizes, ranks_per_replica, world_size
from gptpar.run.folder import RunFolder, in_use, run_folder
from gptpar.run.names import derived_run_id, replaced_name

KINDS = ("dp", "pp")
FILE_SOURCES = ("text", "jsonl", "tsv")  # data.source kinds that name local files


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


JobState = Callable[[RunFolder], "str | None"]  # the scheduler's word on a folder's job (backend.scheduler_state)
LIVE_JOB_STATES = ("pending", "running")


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""


def absolute_paths(cfg: Config) -> dict[str, str]:
    """The config's file paths made absolute, as the submitter means them: ranks run in the run folder
    (local processes) or wherever a job starts, so a relative path would name another file there."""
    kind, _, files = cfg.data.source.partition(":")
    paths = {"data.dir": _absolute(cfg.data.dir), "train.dump_grads": _absolute(cfg.train.dump_grads)}
    if kind in FILE_SOURCES and files:
        paths["data.source"] = f"{kind}:" + ",".join(_absolute(p.strip()) for p in files.split(",") if p.strip())
    return paths


def plan_run(cfg: Config, kind: str | None = None, runs_dir: str | Path | None = None, run_id: str = "",
             write: bool = True, start_over: bool = False, job_state: JobState | None = None) -> Point:
    """Resolve the submit side: job kind, absolute runs folder, run id (explicit, or derived once
    here), concrete tokenizer; then write config.yaml (unless `write` is False, as for --dry-run).
    A folder that is live or holds a different config is refused; `start_over` sets a folder that
    is not live aside first (see write_point)."""
    if kind is not None:
        cfg = shaped(cfg, kind)
    root = Path(runs_dir or cfg.log.runs_dir).resolve()
    name = run_id or cfg.log.run_id or derived_run_id(cfg.log.name)
    folder = run_folder(root, name, "log.run_id" if not run_id else "sweep point")
    cfg = updated(cfg, {"log.runs_dir": str(root), "log.run_id": folder.name, **absolute_paths(cfg),
                        "data.tokenizer": resolve_tokenizer_choice(cfg.data)})
    point = Point(cfg, folder)
    if write:
        write_point(point, start_over, job_state)
    return point


def write_point(point: Point, start_over: bool = False, job_state: JobState | None = None,
                again: str = "pass --start-over to set the old folder aside and start over") -> None:
    """Write a planned point's config.yaml. A live folder is refused naming its holder; a folder that
    holds a different config is refused with what changed (`again` says how to start over), unless
    `start_over`, which first moves any existing folder aside (set_aside)."""
    folder = point.folder
    holder = folder.holder()
    if holder is not None:
        raise GptparError(in_use(folder.path, holder))
    if start_over and folder.path.is_dir() and any(folder.path.iterdir()):
        set_aside(folder, job_state)
    make_folder(folder.path)
    folder.write_config(point.cfg, again)


def make_folder(path: Path) -> None:
    """Create a run (or sweep) folder; an unwritable runs folder is one line naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise GptparError(f"cannot create run folder {path}: {exc.strerror or exc}{where}; "
                          "check log.runs_dir (or --runs-dir)") from None


def set_aside(folder: RunFolder, job_state: JobState | None = None) -> Path:
    """Start a run folder over: move it to `<folder>.replaced-<time>` (never deleted: an edit made by
    mistake can be undone by renaming it back, and a rename cannot be cut off half-way). A folder
    whose run is live (its lock is held) or whose job is pending or running is refused."""
    state = job_state(folder) if job_state is not None else None
    if state in LIVE_JOB_STATES:
        job = folder.read_job_record().get("job_id", "?")
        raise GptparError(f"run folder {folder.path} has a {state} job ({job}); wait for it to end or cancel it "
                          "before starting over")
    target = folder.path.with_name(replaced_name(folder.name))
    for n in range(1, 1000):
        if not target.exists():
            break
        target = folder.path.with_name(f"{replaced_name(folder.name)}.{n}")
    with folder.hold():  # refuses a live folder, naming its holder; the lock moves with the folder
        try:
            os.rename(folder.path, target)
        except OSError as exc:
            raise GptparError(f"cannot set run folder {folder.path} aside as {target.name}: "
                              f"{exc.strerror or exc}") from None
    return target


def rank_command(cfg: Config) -> list[str]:
    """What every rank runs, in its run folder, on every backend: the SLURM script's srun line and the
    local launcher run exactly this, so the two paths cannot drift. The venv is launch.venv's, else
    the one of the interpreter running now (this checkout's)."""
    venv = cfg.launch.venv or sys.prefix
    return [str(Path(venv) / "bin" / "gptpar"), "train", "config.yaml"]
