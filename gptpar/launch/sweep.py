"""Sweeps: a base config expanded over `grid` axes (cartesian) and `zip` axes (paired).

Each point gets a deterministic folder `runs/<sweep>/<key=value,...>`, so re-running a sweep finds
its earlier points: completed, pending and running ones are skipped, failed ones resubmitted
(the trainer resumes from their checkpoint). On SLURM the points of one job shape form one job
array, limited to launch.max_concurrent tasks at a time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptpar.config import ConfigError, apply_dict, load_config, parse_override, read_yaml
from gptpar.errors import GptparError
from gptpar.launch import cluster
from gptpar.launch.profiles import resolve
from gptpar.launch.runs import job_dir, run_state
from gptpar.launch.submit import Point, new_point, run_local, script_for, shape, slug, submit_slurm

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
        points.append((slug(",".join(pairs)) if pairs else "base", pairs))
    return name, kind, points


def build_points(path: str | Path, runs_dir: str = "", overrides: Sequence[str] = ()
                 ) -> tuple[str, str, list[Point]]:
    """Resolved, validated configs of every point: base, then `overrides`, then the point's axes."""
    path = Path(path)
    name, kind, expanded = expand(path)
    data = read_yaml(path)
    base_path = (path.parent / data["config"]) if data.get("config") else None
    points = []
    for point_name, point_overrides in expanded:
        try:
            cfg = load_config(base_path)
            apply_dict(cfg, data.get("base"), origin=str(path))
            apply_dict(cfg, _nest(list(overrides)), origin="command line")
            apply_dict(cfg, _nest(point_overrides), origin=f"{path} point {point_name}")
            shape(cfg, kind)
        except ConfigError as exc:
            raise GptparError(f"{path}: point {point_name}: {exc}") from None
        root = Path(runs_dir or cfg.log.runs_dir) / name
        points.append(new_point(cfg, root, point_name))
    return name, kind, points


def _nest(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """`section.key=value` strings as the section mapping apply_dict takes."""
    tree: dict[str, dict[str, Any]] = {}
    for text in overrides:
        key, value = parse_override(text)
        section, _, name = key.partition(".")
        tree.setdefault(section, {})[name] = value
    return tree


def wait_for(points: Sequence[Point], poll_s: float = 5.0) -> list[str]:
    """Block until no point is pending or running (states come from SLURM, then the logs)."""
    while True:
        states = [run_state(p.run_dir) for p in points]
        if not any(s in ("pending", "running") for s in states):
            return states
        time.sleep(poll_s)


def run_sweep(path: str | Path, dry_run: bool = False, runs_dir: str = "", overrides: Sequence[str] = (),
              wait: bool = False) -> int:
    name, kind, points = build_points(path, runs_dir, overrides)
    todo = [p for p in points if not p.run_dir.exists() or run_state(p.run_dir) not in
            ("completed", "pending", "running")]
    skipped = len(points) - len(todo)
    groups: dict[Any, list[Point]] = {}
    for point in todo:
        groups.setdefault(resolve(point.cfg, kind), []).append(point)
    where = "dry-run" if dry_run else cluster.choose_cluster(points[0].cfg.launch.cluster)
    print(f"sweep {name}: {len(points)} point(s), {skipped} skipped (done or queued), {len(todo)} to run")
    failures = 0
    for spec, members in groups.items():
        out = Path(members[0].cfg.log.runs_dir) / "_jobs" if len(members) > 1 else job_dir(members[0].run_dir)
        if where == "dry-run":
            print(f"# points: {', '.join(p.run_dir.name for p in members)}")
            print(script_for(members, spec, f"{name}-{kind}", out), end="")
        elif where == "slurm":
            job_id = submit_slurm(members, spec, f"{name}-{kind}", out)
            print(f"submitted job {job_id} ({len(members)} point(s)): {', '.join(p.run_dir.name for p in members)}")
        else:
            for point in members:
                status = run_local(point, spec, script_for([point], spec, name, job_dir(point.run_dir)))
                failures += status not in ("completed", "requeued")
                print(f"{point.run_dir.name}: {status}")
    if wait and where == "slurm":
        states = wait_for(points)
        failures = sum(s != "completed" for s in states)
        print(f"sweep {name}: " + ", ".join(f"{p.run_dir.name} {s}" for p, s in zip(points, states, strict=True)))
    return 1 if failures else 0
