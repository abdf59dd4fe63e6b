"""The sweep record: `<runs>/<sweep>/sweep.json`, a sweep's definition as it was last submitted (its files
with their digests, the overrides, each point's config and config digest), and the one rule that says
which run folders no longer hold results of their sweep's current definition (for the report).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gptpar.atomic import atomic_write_text
from gptpar.config import Config, ConfigError, config_digest, config_from_dict
from gptpar.run.folder import config_diff, find_runs
from gptpar.run.names import REPLACED

SWEEP_RECORD = "sweep.json"


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def write_sweep_record(sweep_dir: str | Path, name: str, kind: str, files: Sequence[str | Path],
                       overrides: Sequence[str], points: Mapping[str, Config]) -> Path:
    """Record a sweep's definition as it is submitted: its files (with digests, so a later edit shows),
    the command-line overrides, and each point's resolved config and its gptpar.config.config_digest."""
    path = Path(sweep_dir) / SWEEP_RECORD
    record = {
        "schema": 1, "name": name, "kind": kind, "submitted": time.time(),
        "files": {str(Path(f).resolve()): file_digest(f) for f in files},
        "overrides": list(overrides),
        "points": {point: {"digest": config_digest(cfg), "config": cfg.to_dict()} for point, cfg in points.items()},
    }
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def read_sweep_record(sweep_dir: str | Path) -> dict[str, Any] | None:
    """The record `write_sweep_record` left in `sweep_dir`, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads((Path(sweep_dir) / SWEEP_RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("points"), dict) else None


def saved_digest(saved: dict[str, Any]) -> str:
    """The digest of a config as a run folder saved it (config.yaml), comparable with config_digest."""
    try:
        return config_digest(config_from_dict(saved))
    except (ConfigError, TypeError, ValueError):  # a config of an older schema: no current definition has it
        return "invalid:" + hashlib.sha256(json.dumps(saved, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stale_runs(runs_dir: str | Path) -> dict[Path, str]:
    """Run folders under `runs_dir` whose results do not belong to their sweep's current definition,
    each with one line saying why (for the report to flag or leave out):
    - a folder set aside by --rerun / --start-over (`<name>.replaced-<time>`);
    - a sweep point whose config digest differs from the one recorded in its sweep's sweep.json
      (the sweep was submitted again with another definition and this point was not re-run);
    - a folder in a sweep's folder that is no point of its recorded definition;
    - every point of a sweep whose files (sweep YAML, base config) changed since it was recorded.
    Folders outside any sweep, and unchanged points, are not listed."""
    root = Path(runs_dir)
    found: dict[Path, str] = {}
    for folder in find_runs(root):
        match = REPLACED.search(folder.name)
        if match:
            found[folder.path] = (f"set aside on {match.group(1)} by --rerun or --start-over: "
                                  "results of an earlier config")
    for record_path in sorted(root.rglob(SWEEP_RECORD)):
        sweep_dir = record_path.parent
        record = read_sweep_record(sweep_dir)
        if record is None:
            for folder in find_runs(sweep_dir):
                found.setdefault(folder.path, f"{record_path} is unreadable; run `gptpar sweep` again to rewrite it")
            continue
        sweep, points = record.get("name", sweep_dir.name), record["points"]
        edited = [f for f, digest in (record.get("files") or {}).items()
                  if Path(f).is_file() and file_digest(f) != digest]
        for folder in find_runs(sweep_dir):
            if folder.path.parent != sweep_dir or folder.path in found:
                continue
            point = points.get(folder.name)
            try:
                saved = folder.read_config()
            except (OSError, ValueError, yaml.YAMLError):
                saved = None
            if not isinstance(point, dict):
                found[folder.path] = f"not a point of sweep {sweep}'s current definition"
            elif isinstance(saved, dict) and saved_digest(saved) != point.get("digest"):
                found[folder.path] = (f"config differs from sweep {sweep}'s current definition "
                                      f"({config_diff(saved, point.get('config') or {}, limit=2)})")
            elif edited:
                found[folder.path] = (f"{edited[0]} was edited after sweep {sweep} was submitted; "
                                      "submit the sweep again to check its points")
    return found
