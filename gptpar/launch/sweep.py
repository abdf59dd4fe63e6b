"""Sweeps: a base config expanded over `grid` axes (cartesian) and `zip` axes (paired).

Each point gets a deterministic folder `runs/<sweep>/<key=value,...>` (gptpar.run.names.point_name),
so re-running a sweep finds its earlier points: completed, pending and running ones are skipped,
failed ones resubmitted (the trainer resumes from their checkpoint). On SLURM the points of one job
shape form one job array, limited to launch.max_concurrent tasks at a time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptpar.config import ConfigError, apply_dict, load_config, parse_override, read_yaml, validate
from gptpar.errors import GptparError
from gptpar.launch.backend import choose_backend, scheduler_state
from gptpar.launch.plan import Point, plan_run, shaped
from gptpar.launch.profiles import resolve
from gptpar.launch.render import render_script
from gptpar.launch.submit import report_started
from gptpar.run.names import point_name, slug
from gptpar.run.state import read_run

SWEEP_KEYS = ("name", "kind", "config", "base", "grid", "zip")


def _axes(data: dict[str, Any], key: str, path: Path) -> dict[str, list[Any]]:
    axes = data.get(key) or {}
    if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
        raise GptparError(f"{path}: {key} must map section.key names to non-empty lists of values")
    return axes


def expand(path: str | Path) -> tuple[str, str, list[tuple[str, list[str]]]]:
    """(sweep name, job kind, [(point name, overrides)]) in a deterministic order."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise GptparError(f"{path}: a sweep is a mapping with keys {', '.join(SWEEP_KEYS)}")
    unknown = set(data) - set(SWEEP_KEYS)
    if unknown:
        raise GptparError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(SWEEP_KEYS)}")
    name = slug(str(data.get("name") or path.stem))
    kind = str(data.get("kind", "dp"))
    grid, zipped = _axes(data, "grid", path), _axes(data, "zip", path)
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        raise GptparError(f"{path}: zip axes must have equal lengths, got {', '.join(map(str, lengths))}")
    zip_rows = list(zip(*zipped.values(), strict=True)) if zipped else [()]
    grid_rows = list(itertools.product(*grid.values()))
    keys = [*zipped, *grid]
    points = []
    for zrow, grow in itertools.product(zip_rows, grid_rows):
        pairs = [f"{k}={v}" for k, v in zip(keys, (*zrow, *grow), strict=True)]
        points.append((point_name(pairs), pairs))
    return name, kind, points


def build_points(path: str | Path, runs_dir: str = "", overrides: Sequence[str] = (), write: bool = False
                 ) -> tuple[str, str, list[Point]]:
    """Resolved, validated configs of every point: base, then `overrides`, then the point's axes."""
    path = Path(path)
    name, kind, expanded = expand(path)
    data = read_yaml(path)
    base_path = (path.parent / data["config"]) if data.get("config") else None
    points = []
    for name_of_point, point_overrides in expanded:
        try:
            cfg = apply_dict(load_config(base_path), data.get("base"), origin=str(path))
            cfg = apply_dict(cfg, _nest(list(overrides)), origin="command line")
            cfg = apply_dict(cfg, _nest(point_overrides), origin=f"{path} point {name_of_point}")
            validate(cfg)
            cfg = shaped(cfg, kind)
        except ConfigError as exc:
            raise GptparError(f"{path}: point {name_of_point}: {exc}") from None
        root = Path(runs_dir or cfg.log.runs_dir) / name
        points.append(plan_run(cfg, None, root, name_of_point, write=write))
    return name, kind, points


def _nest(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """`section.key=value` strings as the section mapping apply_dict takes."""
    tree: dict[str, dict[str, Any]] = {}
    for text in overrides:
        key, value = parse_override(text)
        section, _, name = key.partition(".")
        tree.setdefault(section, {})[name] = value
    return tree


def point_state(point: Point) -> str:
    return read_run(point.folder, scheduler=scheduler_state(point.folder)).state


def wait_for(points: Sequence[Point], poll_s: float = 5.0) -> list[str]:
    """Block until no point is pending or running (states come from SLURM, then the logs)."""
    while True:
        states = [point_state(p) for p in points]
        if not any(s in ("pending", "running") for s in states):
            return states
        time.sleep(poll_s)


def run_sweep(path: str | Path, dry_run: bool = False, runs_dir: str = "", overrides: Sequence[str] = (),
              wait: bool = False) -> int:
    name, kind, points = build_points(path, runs_dir, overrides, write=not dry_run)
    todo = [p for p in points if not p.folder.rank_logs() or point_state(p) not in
            ("completed", "diverged", "pending", "running")]
    skipped = len(points) - len(todo)
    groups: dict[Any, list[Point]] = {}
    for point in todo:
        groups.setdefault(resolve(point.cfg, kind), []).append(point)
    backend = None if dry_run else choose_backend(points[0].cfg.launch.cluster, points[0].cfg.launch.profile)
    where = backend.where if backend else "nowhere (dry run)"
    print(f"sweep {name}: {len(points)} point(s), {skipped} skipped (done or queued), {len(todo)} to run on {where}",
          flush=True)
    failures = 0
    for spec, members in groups.items():
        out = Path(members[0].cfg.log.runs_dir) / "_jobs" if len(members) > 1 else members[0].folder.job_dir
        if backend is None:
            print(f"# points: {', '.join(p.folder.name for p in members)}")
            print(render_script(members, spec, f"{name}-{kind}", out), end="")
            continue
        job_ids = backend.submit(members, spec, f"{name}-{kind}", out)
        failures += sum(not report_started(p, backend, j) for p, j in zip(members, job_ids, strict=True))
    if wait and backend is not None:
        states = wait_for(points)
        failures = sum(s != "completed" for s in states)
        print(f"sweep {name}: " + ", ".join(f"{p.folder.name} {s}" for p, s in zip(points, states, strict=True)))
    return 1 if failures else 0
