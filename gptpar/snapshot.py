"""A copy of the gptpar package taken when a submitit job is submitted, so that editing the checkout while the
job waits in the queue does not change what it runs (submitit's RsyncSnapshot idea, in Python: rsync is not
installed everywhere).

The copy holds the files git lists for the package, tracked or new but not ignored, as they are in the working
tree; outside a git checkout (an installed package), the package's own files. The job puts the copy first on
PYTHONPATH (gptpar.launch.submitit_backend); the copy knows it is one (SNAPSHOT_FILE), and each rank's log
header records the commit it was taken at and whether the tree differed from it (gptpar.train.provenance).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from gptpar.atomic import atomic_write_text
from gptpar.errors import GptparError

PACKAGE = Path(__file__).resolve().parent
SNAPSHOT_FILE = "_snapshot.json"  # inside a copy's package folder: what it was copied from


def _git(*args: str) -> str | None:
    """git's output about the folder holding the package, or None where there is no git or no checkout."""
    try:
        result = subprocess.run(["git", "-C", str(PACKAGE.parent), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def _package_files() -> tuple[list[str], str, bool | None]:
    """(files relative to the package's parent, commit, dirty): git's view in a checkout, else the installed files
    with the commit of the snapshot this package itself runs from, if any."""
    tracked = _git("ls-files", "-z", "--", PACKAGE.name)
    if tracked:
        listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", PACKAGE.name) or ""
        files = sorted({name for name in listed.split("\0") if name and (PACKAGE.parent / name).is_file()})
        status = _git("status", "--porcelain", "--", PACKAGE.name)
        return files, (_git("rev-parse", "HEAD") or "unknown").strip(), None if status is None else bool(status)
    files = sorted(path.relative_to(PACKAGE.parent).as_posix() for path in PACKAGE.rglob("*")
                   if path.is_file() and "__pycache__" not in path.parts and path.name != SNAPSHOT_FILE)
    running = running_snapshot() or {}
    return files, running.get("commit", "unknown"), running.get("dirty")


def take_snapshot(dest: Path) -> dict[str, Any]:
    """Copy the package into `dest` (a new or empty folder) and record where it came from; returns that record."""
    files, commit, dirty = _package_files()
    try:
        for name in files:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PACKAGE.parent / name, target)
    except OSError as exc:
        raise GptparError(f"cannot copy the code snapshot into {dest} ({exc.strerror or exc}); check that the "
                          "run folder is writable and has space") from None
    info = {"source": str(PACKAGE), "commit": commit, "dirty": dirty, "files": len(files), "time": time.time()}
    atomic_write_text(dest / PACKAGE.name / SNAPSHOT_FILE, json.dumps(info) + "\n")
    return info


def running_snapshot() -> dict[str, Any] | None:
    """The record of the snapshot this process runs gptpar from, with its folder; None when it runs a checkout or
    an installed package."""
    path = PACKAGE / SNAPSHOT_FILE
    if not path.is_file():
        return None
    return {"path": str(PACKAGE.parent), **json.loads(path.read_text())}
