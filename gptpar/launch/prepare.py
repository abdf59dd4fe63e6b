"""The submit side's resolution of a config, done once before anything runs: the job's shape from the
rank grid, absolute file paths and the tokenizer; the run is named and its config.yaml written by
gptpar.run.start.

`gptpar submit`, `gptpar sweep` and a `gptpar train` that starts its own ranks (or trains in this process)
all come through `prepare_run`; the ranks then only check it against what the launcher started
(gptpar.parallel.grid.launched_config) and claim its folder (gptpar.run.claim).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from gptpar.cluster.shape import shaped
from gptpar.config import Config, LogConfig, check_expert_grid, data_config, updated
from gptpar.data.tokenizer import resolve_tokenizer_choice
from gptpar.plan.record import SHIPPED, write_plan
from gptpar.pretrained import PREFIX, folder_of
from gptpar.run.folder import RunFolder
from gptpar.run.start import START_OVER, JobState, named_run, write_folder

FILE_SOURCES = ("text", "jsonl", "tsv")  # data.source kinds that name local files


@dataclass(frozen=True)
class Point:
    """One run to start: its resolved config and its folder, and for a sweep point its name in the sweep's keys
    (gptpar.run.names.point_label), which the local launcher's start line gives."""

    cfg: Config
    folder: RunFolder
    label: str = ""


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""


def absolute_paths(cfg: Config) -> dict[str, str]:
    """The config's file paths made absolute, as the submitter means them: ranks run in the run folder
    (local processes) or wherever a job starts, so a relative path would name another file there."""
    kind, _, files = cfg.data.source.partition(":")
    paths = {"data.dir": _absolute(cfg.data.dir), "train.dump_grads": _absolute(cfg.train.dump_grads)}
    if cfg.report.plan_calibration not in ("", SHIPPED):
        paths["report.plan_calibration"] = _absolute(cfg.report.plan_calibration)
    for key, setting in (("model.init", cfg.model.init), ("data.tokenizer", cfg.data.tokenizer)):
        if (folder := folder_of(setting)) is not None:
            paths[key] = PREFIX + _absolute(str(folder))
    if kind in FILE_SOURCES and files:
        paths["data.source"] = f"{kind}:" + ",".join(_absolute(p.strip()) for p in files.split(",") if p.strip())
    return paths


def prepare_run(cfg: Config, kind: str | None = None, runs_dir: str | Path | None = None, run_id: str = "",
             write: bool = True, start_over: bool = False, job_state: JobState | None = None,
             stack: contextlib.ExitStack | None = None, reshape: bool = False, dp_set: bool | None = None) -> Point:
    """Resolve the submit side: job kind, absolute runs folder, run id (explicit, or derived once
    by gptpar.run.start.named_run), concrete tokenizer; then write config.yaml (unless `write` is False,
    as for --dry-run). A folder that is live or holds a different config is refused; `start_over` sets a
    folder that is not live aside first; `reshape` lets a stopped run continue on another layout; with `stack`, the
    run's lock stays held until it closes (see gptpar.run.start.write_folder); `dp_set`: as
    gptpar.cluster.shape.shaped takes it."""
    if kind is not None:
        cfg = shaped(cfg, kind, dp_set)
    check_expert_grid(cfg)
    root = Path(runs_dir or cfg.log.runs_dir).resolve()
    prefix = kind if kind is not None and cfg.log.name == LogConfig().name else ""  # `dp.3`, unless log.name is set
    cfg = updated(cfg, {"log.runs_dir": str(root), **absolute_paths(cfg)})
    from gptpar.data.fetch import check_local_data, require_hub_data  # bad data is said before any folder

    require_hub_data(cfg.data)
    check_local_data(cfg.data)
    cfg, folder = named_run(cfg, run_id, root, "log.run_id" if not run_id else "sweep point", prefix, reserve=write)
    cfg = updated(cfg, {"data.tokenizer": resolve_tokenizer_choice(data_config(cfg))})
    if write:
        write_run_folder(folder, cfg, start_over, job_state, stack=stack, reshape=reshape)
    return Point(cfg, folder)


def write_run_folder(folder: RunFolder, cfg: Config, start_over: bool = False, job_state: JobState | None = None,
                     again: str = START_OVER, stack: contextlib.ExitStack | None = None, reshape: bool = False
                     ) -> None:
    """The submit side's run folder: gptpar.run.start.write_folder, then the run's plan.json (its prediction,
    before any rank starts) where report.plan_calibration asks for one."""
    write_folder(folder, cfg, start_over, job_state, again, stack, reshape)
    if cfg.report.plan_calibration:
        write_plan(folder.path, cfg)


def rank_command(cfg: Config) -> list[str]:
    """What every rank runs, in its run folder, on every backend: the SLURM script's srun line and the
    local launcher run exactly this, so the two paths cannot drift. The venv is launch.venv's, else
    the one of the interpreter running now (this checkout's)."""
    venv = cfg.launch.venv or sys.prefix
    return [str(Path(venv) / "bin" / "gptpar"), "train", "config.yaml"]
