"""Sweeps: a base config expanded over `grid` axes (cartesian) and `zip` axes (paired), `repeats` times.

Each point gets a deterministic folder `runs/<sweep>/<key=value,...>` (gptpar.run.names.point_name),
so re-running a sweep finds its earlier points: completed, pending and running ones are skipped,
failed ones resubmitted (the trainer resumes from their checkpoint). On SLURM the points of one job
shape form one job array, limited to launch.max_concurrent tasks at a time.

A point is done only for the config it ran with: after the sweep's definition changes, points whose
folders hold another config are refused in one line, and `--rerun` sets those folders aside
(`<point>.replaced-<time>`) and starts the points over. Each submission records the definition in
`runs/<sweep>/sweep.json` (gptpar.run.sweeps.write_sweep_record; the report flags what
gptpar.run.sweeps.stale_runs finds). Nothing is resolved silently: an axis given twice, or a
parallel.dp the job's shape would replace, is an error.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gptpar.cluster.shape import shaped
from gptpar.config import ConfigError, config_layers, overrides_tree, parse_override, read_yaml, resolve_layers
from gptpar.errors import GptparError
from gptpar.launch.backend import Backend, choose_backend, job_text, scheduler_state
from gptpar.launch.prepare import Point, prepare_run, write_run_folder
from gptpar.launch.profiles import account_warning, resolve
from gptpar.launch.submit import report_started
from gptpar.run.folder import completed, config_diff
from gptpar.run.names import point_label, point_name, short_hash, slug
from gptpar.run.queue import dequeue, queued
from gptpar.run.start import make_folder, set_aside
from gptpar.run.state import FINISHED, LIVE_JOB_STATES, NEVER_STARTS, read_run
from gptpar.run.sweeps import write_sweep_record
from gptpar.user_defaults import user_layers

SWEEP_KEYS = ("name", "kind", "config", "base", "grid", "zip", "repeats")
MAX_REPEATS = 100
SHOWN_POINTS = 20  # point names a dry run prints per job array; the rest are counted


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
    keys = [*zipped, *grid]
    seen: dict[str, str] = {}
    for key, where in [*((k, "zip") for k in zipped), *((k, "grid") for k in grid)]:
        if str(key).strip() in seen:  # the same key twice in one mapping is read_yaml's error
            raise GptparError(f"{path}: axis {str(key).strip()!r} appears in both {seen[str(key).strip()]} and "
                              f"{where}; keep one")
        seen[str(key).strip()] = where
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        raise GptparError(f"{path}: zip axes must have equal lengths, got {', '.join(map(str, lengths))}")
    zip_rows = list(zip(*zipped.values(), strict=True)) if zipped else [()]
    grid_rows = list(itertools.product(*grid.values()))
    rows = [[f"{k}={v}" for k, v in zip(keys, (*zrow, *grow), strict=True)]
            for zrow, grow in itertools.product(zip_rows, grid_rows)]
    repeats = _repeats(data, path)
    if repeats > 1 and "launch.repeat" in seen:
        raise GptparError(f"{path}: launch.repeat is an axis and repeats={repeats} numbers the repeats too; keep one")
    # Repeats go round the whole sweep before a point runs again, so a drift of the machine spreads over
    # every point instead of favouring the first ones; the report measures run-to-run spread from them.
    points = [(point_name(pairs), pairs) for pairs in (
        [*row, f"launch.repeat={r}"] if repeats > 1 else row for r in range(repeats) for row in rows)]
    return name, kind, _distinct(path, points)


def _repeats(data: dict[str, Any], path: Path) -> int:
    repeats = data.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise GptparError(f"{path}: repeats must be an integer from 1 to {MAX_REPEATS}, got {repeats!r}")
    return repeats


def _distinct(path: Path, points: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """A point listed twice is an error; distinct points whose names coincide (a value holding
    `,key=`) get a hash of their values, so every point has a folder of its own."""
    by_name: dict[str, list[list[str]]] = {}
    for name, pairs in points:
        if pairs in by_name.get(name, []):
            raise GptparError(f"{path}: point {name} appears twice (a value repeated in an axis); keep one")
        by_name.setdefault(name, []).append(pairs)
    return [(name if len(by_name[name]) == 1 else f"{slug(name, 90)}-{short_hash(repr(pairs))}", pairs)
            for name, pairs in points]


def build_points(path: str | Path, runs_dir: str = "", overrides: Sequence[str] = (), write: bool = False
                 ) -> tuple[str, str, list[Point]]:
    """Resolved, validated configs of every point: base, then `overrides`, then the point's axes."""
    path = Path(path)
    name, kind, expanded = expand(path)
    data = read_yaml(path)
    base_path = _base_path(path, data)
    # Read once, not per point: the user's defaults (detecting the cluster reads every profile) and the base file.
    points, below = [], [*user_layers(), *config_layers(base_path)]
    base_yaml = read_yaml(base_path) if base_path else None
    for name_of_point, point_overrides in expanded:
        try:
            layers = [*below, (str(path), data.get("base")),
                      ("command line", overrides_tree(overrides)),
                      (f"{path} point {name_of_point}", overrides_tree(point_overrides))]
            cfg = resolve_layers(layers)[0]
            if cfg.log.run_id:
                raise ConfigError(f"log.run_id={cfg.log.run_id!r} is set, but a sweep names each point's folder "
                                  "itself; drop log.run_id")
            cfg = shaped(cfg, kind, _sets_dp(base_yaml, data, [*overrides, *point_overrides]))
        except ConfigError as exc:
            raise GptparError(f"{path}: point {name_of_point}: {exc}") from None
        runs = Path(runs_dir or cfg.log.runs_dir).resolve()
        root = (runs / name).resolve()
        if root.parent != runs:
            raise GptparError(f"{path}: sweep folder {runs / name} resolves to {root}, outside the runs folder {runs}")
        points.append(replace(prepare_run(cfg, None, root, name_of_point, write=write),
                              label=point_label(point_overrides)))
    return name, kind, points


def _base_path(path: Path, data: dict[str, Any]) -> Path | None:
    return (path.parent / data["config"]) if data.get("config") else None


def _sets_dp(base_yaml: Any, data: dict[str, Any], overrides: Sequence[str]) -> bool:
    """Whether the sweep (its base config file, base, command line or axes) sets parallel.dp itself."""
    sections = [base_yaml, data.get("base")]
    in_yaml = any(isinstance(s, dict) and isinstance(s.get("parallel"), dict) and "dp" in s["parallel"]
                  for s in sections)
    return in_yaml or any(parse_override(o)[0] == "parallel.dp" for o in overrides)


def point_state(point: Point) -> str:
    return read_run(point.folder, scheduler=scheduler_state(point.folder)).state


def wait_for(points: Sequence[Point], poll_s: float = 5.0) -> list[str]:
    """Block until no point is pending or running (states come from SLURM, then the logs), or only those remain
    pending that will never start (each said once, with its fix)."""
    said: set[Path] = set()
    while True:
        runs = [read_run(p.folder, scheduler=scheduler_state(p.folder)) for p in points]
        stuck = [r for r in runs if r.state == "pending" and r.detail.startswith(NEVER_STARTS)]
        for run in stuck:
            if run.folder.path not in said:
                print(f"{run.folder.name}: {run.detail}", flush=True)
                said.add(run.folder.path)
        if not any(r.state in LIVE_JOB_STATES for r in runs if all(r is not s for s in stuck)):
            return [r.state for r in runs]
        time.sleep(poll_s)


def stale_points(points: Sequence[Point]) -> list[tuple[Point, dict[str, Any]]]:
    """Points whose folder holds a config other than the point's current one, with that config."""
    found = []
    for point in points:
        saved = point.folder.read_config()
        if saved is not None and (saved := completed(saved)) != point.cfg.to_dict():
            found.append((point, saved))
    return found


def _listed(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def stale_message(name: str, stale: Sequence[tuple[Point, dict[str, Any]]]) -> str:
    """One line: which points hold results of another config, what changed, and how to re-run them."""
    groups: dict[str, list[str]] = {}
    for point, saved in stale:
        groups.setdefault(config_diff(saved, point.cfg.to_dict(), limit=3), []).append(point.folder.name)
    parts = [f"{_listed(names)} ({diff})" for diff, names in groups.items()]
    shown = "; ".join(parts[:2]) + (f"; and {len(parts) - 2} other change(s)" if len(parts) > 2 else "")
    return (f"sweep {name}: {len(stale)} point(s) hold results of a different config: {shown}; "
            "add --rerun to start them over (their folders are kept as <point>.replaced-<time>)")


def prepare(path: Path, name: str, kind: str, points: Sequence[Point], overrides: Sequence[str],
            rerun: bool) -> None:
    """Before anything is submitted: record the sweep's definition, refuse (or, with `rerun`, set
    aside) points whose folders hold another config, and write each new point's config.yaml."""
    base = _base_path(path, read_yaml(path))
    for sweep_dir in sorted({p.folder.path.parent for p in points}):
        make_folder(sweep_dir)
        write_sweep_record(sweep_dir, name, kind, [path, *([base] if base else [])], overrides,
                           {p.folder.name: p.cfg for p in points if p.folder.path.parent == sweep_dir})
    stale = stale_points(points)
    if stale and not rerun:
        raise GptparError(stale_message(name, stale))
    live = [f"{point.folder.name} ({why})" for point, _ in stale if (why := _live(point))]
    if live:
        raise GptparError(f"sweep {name}: --rerun leaves live points alone: {_listed(live, 2)}; wait for them to "
                          "end or cancel them, then run again")
    for point, _ in stale:
        moved = set_aside(point.folder, scheduler_state)
        print(f"sweep {name}: {point.folder.name}: old results set aside as {moved.name}", flush=True)
    for point in points:
        if point.folder.read_config() is None:
            write_run_folder(point.folder, point.cfg, again="add --rerun to start it over")


def _live(point: Point) -> str:
    """Why a point's folder must not be touched now ("" when nothing runs in it)."""
    holder = point.folder.holder()
    if holder is not None:
        return f"held by host {holder.get('host', '?')} pid {holder.get('pid', '?')}"
    state = scheduler_state(point.folder)
    return f"{state} job {point.folder.read_job_record().get('job_id', '?')}" if state in LIVE_JOB_STATES else ""


def submit_sweep(path: str | Path, runs_dir: str = "", overrides: Sequence[str] = (), rerun: bool = False,
                 dry_run: bool = False) -> tuple[list[Point], Backend | None, int]:
    """Submit the points of a sweep that are not done or queued (a dry run prints their jobs instead); every
    point, the backend (None for a dry run) and the count of points that failed to start."""
    path = Path(path)
    name, kind, points = build_points(path, runs_dir, overrides)
    # Where the points run is decided before any folder is touched: an unreachable SLURM leaves none.
    backend = None if dry_run else choose_backend(points[0].cfg.launch)
    for spec in {resolve(p.cfg, kind) for p in points} if backend is not None else ():
        backend.check(spec)  # a shape that could never start, refused before any folder is touched
    stale = stale_points(points)
    if backend is not None:
        prepare(path, name, kind, points, overrides, rerun)
    elif stale and not rerun:
        print(f"# would refuse: {stale_message(name, stale)}")
    again = {p.folder.name for p, _ in stale} if rerun else set()
    todo = [p for p in points if p.folder.name in again or not p.folder.rank_logs() or point_state(p) not in
            (*FINISHED, *LIVE_JOB_STATES)]
    skipped = len(points) - len(todo)
    # One job array per round of repeats and job shape, in sweep order: locally the rounds run one after another.
    groups: dict[tuple[int, Any], list[Point]] = {}
    for point in todo:
        groups.setdefault((point.cfg.launch.repeat, resolve(point.cfg, kind)), []).append(point)
    where = backend.where if backend else "nowhere (dry run)"
    print(f"sweep {name}: {len(points)} point(s), {skipped} skipped (done or queued), {len(todo)} to run on {where}",
          flush=True)
    if backend is None:
        for warning in sorted({w for _, spec in groups if (w := account_warning(spec, os.environ)) is not None}):
            print(warning, file=sys.stderr)
        for (_, spec), members in groups.items():
            out = Path(members[0].cfg.log.runs_dir) / "_jobs" if len(members) > 1 else members[0].folder.job_dir
            print(f"# points: {_listed([p.folder.name for p in members], SHOWN_POINTS)}")
            print(job_text(members, spec, f"{name}-{kind}", out), end="")
        return points, None, 0
    failures = 0
    with queued([p.folder for p in todo]):  # each point reads `queued` until its job takes it
        for (_, spec), members in groups.items():
            out = Path(members[0].cfg.log.runs_dir) / "_jobs" if len(members) > 1 else members[0].folder.job_dir
            job_ids = backend.submit(members, spec, f"{name}-{kind}", out)
            dequeue([p.folder for p in members])  # handed over: their job says what becomes of them
            failures += sum(not report_started(p, backend, j) for p, j in zip(members, job_ids, strict=True))
    return points, backend, failures


def run_sweep(path: str | Path, dry_run: bool = False, runs_dir: str = "", overrides: Sequence[str] = (),
              wait: bool = False, rerun: bool = False) -> int:
    points, backend, failures = submit_sweep(path, runs_dir, overrides, rerun, dry_run)
    if wait and backend is not None:
        states = wait_for(points)
        failures = sum(s != "completed" for s in states)
        print(f"sweep {points[0].folder.path.parent.name}: "
              + ", ".join(f"{p.folder.name} {s}" for p, s in zip(points, states, strict=True)))
    return 1 if failures else 0
