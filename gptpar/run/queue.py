"""A launcher's queue: the runs a process will start, one after another (a local sweep runs its points in turn).

Each queued run's `job/queue.lock` is held by the launcher (a RunLock: its flock dies with the process, its heartbeat
tells other hosts) from when the run is queued until its ranks end, with the job id and the time once its ranks
start (a rank header from then on means they have started: the records decide from there). So
gptpar.run.state tells a run waiting its turn (`queued`) and one whose ranks are starting (`starting`) from one that
died before its first log record, and a launcher that was killed leaves no run looking queued.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from gptpar.run.folder import QUEUE_LOCK, RunFolder, RunLock

_HELD: dict[Path, RunLock] = {}  # this process's queue: the lock of each run it has queued and not yet ended


def _lock(folder: RunFolder, job_id: str = "") -> RunLock:
    lock = RunLock(folder.job_dir / QUEUE_LOCK)
    lock.acquire(job_id)
    _HELD[folder.path] = lock
    return lock


@contextmanager
def queued(folders: Sequence[RunFolder]) -> Iterator[None]:
    """Hold `folders` queued by this process until the block ends (each is released sooner when its ranks end)."""
    for folder in folders:
        _lock(folder)
    try:
        yield
    finally:
        dequeue(folders)


def dequeue(folders: Sequence[RunFolder]) -> None:
    """Let go of queued runs: their job now says what becomes of them (or nothing will start them)."""
    for folder in folders:
        if (lock := _HELD.pop(folder.path, None)) is not None:
            lock.release()


@contextmanager
def starting(folder: RunFolder, job_id: str) -> Iterator[None]:
    """Mark a run's ranks starting as job `job_id` (queued by this process or not), until they end."""
    lock = _HELD.get(folder.path) or _lock(folder)
    lock.relabel(job_id)
    try:
        yield
    finally:
        dequeue([folder])
