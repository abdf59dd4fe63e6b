"""A run folder's paths, its config, its job record, and the lock held by a live run.

The lock is an flock on `.lock`, which dies with its process; the file also holds the holder's host,
pid, job id and a heartbeat, so a run on another node, or on a filesystem without working flock
(some Lustre mounts), is still seen as live while its heartbeat is fresh.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gptpar.atomic import atomic_write_text
from gptpar.config import Config, to_yaml
from gptpar.errors import GptparError
from gptpar.run.logfile import RANK_ENTRY, RANK_FILE, RANK_GLOB, rank_log_path, rank_of
from gptpar.run.names import check_run_id

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoint"  # gptpar.train.checkpoint writes it (and checkpoint.tmp, checkpoint.old on the way)
TMP_SUFFIX, OLD_SUFFIX = ".tmp", ".old"
EXPORT_FILE = "checkpoint.pt"  # `gptpar checkpoint export`'s default output, beside the checkpoint (no run reads it)
# A LoRA run's exports (`gptpar checkpoint export`, with --merge): peft's adapter folder, the merged model's folder
ADAPTER_FOLDER, MERGED_FOLDER = "adapter", "merged"
LOCK_FILE = ".lock"
PLAN_FILE = "plan.json"  # gptpar.plan.record: the run's prediction
RESHAPE_FILE = "reshape.json"  # the layout a `--reshape` accepted, which the ranks then take (gptpar.run.resume)
TB_FOLDER, WANDB_FOLDER = "tb", "wandb"  # gptpar.run.sinks' mirrors
# The names a run folder gives meaning to, besides its rank logs: a file written over one of them (or into one) loses
# the run's config, checkpoint or records.
RUN_ENTRIES = frozenset({CONFIG_FILE, LOCK_FILE, PLAN_FILE, RESHAPE_FILE, CHECKPOINT_DIR, CHECKPOINT_DIR + TMP_SUFFIX,
                         CHECKPOINT_DIR + OLD_SUFFIX, "job", "trace", TB_FOLDER, WANDB_FOLDER})
CANCEL_FILE = "cancelled.json"  # in job/: written by `gptpar cancel`
LOCK_FD_ENV = "GPTPAR_RUN_LOCK_FD"  # the descriptor of the run lock a launcher holds for the ranks it starts
QUEUE_LOCK = "queue.lock"  # in job/: held by the launcher process that will start the run (gptpar.run.queue)
HEARTBEAT_S = 30.0
STALE_AFTER_S = 3 * HEARTBEAT_S
RECORD_BYTES = 512  # a lock record's fixed size, padded: see RunLock._write_heartbeat


@dataclass(frozen=True)
class RunFolder:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def job_dir(self) -> Path:
        """The job's script, job.json and stdout/stderr of the job and of its ranks."""
        return self.path / "job"

    def rank_log(self, rank: int) -> Path:
        return rank_log_path(self.path, rank)

    @property
    def trace_dir(self) -> Path:
        """Each rank's profiler trace of train.profile_steps, rank<R>.json (Chrome trace format)."""
        return self.path / "trace"

    def trace_path(self, rank: int) -> Path:
        return self.trace_dir / f"rank{rank}.json"

    @property
    def nccl_trace_prefix(self) -> Path:
        """Where torch's NCCL flight recorder dumps, one file per rank (this plus the rank; gptpar.parallel.
        process_group.nccl_env)."""
        return self.job_dir / "nccl_trace_rank_"

    def flight_path(self, rank: int) -> Path:
        """A rank's flight recorder and frames, dumped when a job hangs (gptpar.parallel.flight)."""
        return self.job_dir / f"rank{rank}.flight.json"

    def live_path(self, rank: int) -> Path:
        """A rank's collective in flight, rewritten every second while it trains (gptpar.parallel.flight.live_state)."""
        return self.job_dir / f"rank{rank}.live.json"

    def ledger_path(self, rank: int) -> Path:
        """A rank's flight recorder as it goes, one line per collective (gptpar.parallel.flight.Ledger)."""
        return self.job_dir / f"rank{rank}.ledger"

    def stack_path(self, rank: int) -> Path:
        """Every thread's Python stack of a rank, appended at each dump (gptpar.parallel.flight)."""
        return self.job_dir / f"rank{rank}.stack"

    def rank_logs(self) -> list[Path]:
        """Every rank<R>.jsonl, by rank."""
        return sorted((p for p in self.path.glob(RANK_GLOB) if RANK_FILE.fullmatch(p.name)),
                      key=lambda p: rank_of(p) or 0)

    def read_config(self) -> dict[str, Any] | None:
        if not self.config_path.is_file():
            return None
        return yaml.safe_load(self.config_path.read_text(encoding="utf-8")) or {}

    def write_config(self, cfg: Config) -> None:
        """Write config.yaml atomically; whether a start may change it is gptpar.run.resume's to decide."""
        atomic_write_text(self.config_path, to_yaml(cfg))

    def read_reshape(self) -> list[str] | None:
        """The layout the last `--reshape` accepted (gptpar.run.resume's lines); None if none did."""
        path = self.path / RESHAPE_FILE
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def write_reshape(self, layout: list[str]) -> None:
        atomic_write_text(self.path / RESHAPE_FILE, json.dumps(layout, indent=1) + "\n")

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_DIR

    def has_checkpoint(self) -> bool:
        """A checkpoint to resume from: `checkpoint`, or `checkpoint.old` where a save was killed between renames."""
        return self.checkpoint_path.exists() or self.path.joinpath(CHECKPOINT_DIR + OLD_SUFFIX).exists()

    def holds_run(self) -> bool:
        """Whether a run has started here: rank logs, a checkpoint or job/ (config.yaml alone is only planned)."""
        return bool(self.rank_logs()) or self.job_dir.is_dir() or any(self.path.glob(f"{CHECKPOINT_DIR}*"))

    def write_job_record(self, backend: str, job_id: str, kind: str) -> None:
        """The job that runs this folder, and the `gptpar submit` kind that made it (what resubmits it)."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.job_dir / "job.json",
                          json.dumps({"backend": backend, "job_id": job_id, "kind": kind}) + "\n")

    def read_job_record(self) -> dict[str, str]:
        """{"backend": "slurm"|"local"|..., "job_id": ..., "kind": "dp"|"pp"} ("kind" absent from older records), or
        {} for a run started by hand."""
        path = self.job_dir / "job.json"
        if not path.is_file():
            return {}
        record = json.loads(path.read_text())
        record.setdefault("backend", record.pop("cluster", ""))  # schema-1 folders said "cluster"
        return record

    def record_cancel(self, job_id: str) -> None:
        """Note that `gptpar cancel` ended this job: SLURM's CANCELLED otherwise reads as a failure, the same as a
        job that died, and a job cancelled before its first record leaves nothing else behind."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.job_dir / CANCEL_FILE, json.dumps({"job_id": job_id, "time": time.time()}) + "\n")

    def cancelled_at(self) -> float | None:
        """When `gptpar cancel` last ended this run's job (Unix seconds), or None."""
        path = self.job_dir / CANCEL_FILE
        try:
            return float(json.loads(path.read_text())["time"])
        except (OSError, ValueError, KeyError, TypeError):  # none, or unreadable: not a cancellation
            return None

    def job_errors(self) -> list[Path]:
        return sorted(p for p in self.job_dir.glob("*.err") if p.is_file())

    @contextmanager
    def hold(self, job_id: str = "", hand_down: bool = False, adopt: bool = False) -> Iterator[RunLock]:
        """Hold the folder until the block ends: a second run into it is refused, naming us. `hand_down`: a launcher's
        hold, passed on to the ranks it starts (LOCK_FD_ENV); `adopt`: a rank's hold, taking over its launcher's where
        it was handed down, so that the run is held from its launcher's start, not only from its ranks'."""
        lock = RunLock(self.path / LOCK_FILE)
        lock.acquire(job_id, adopt)
        try:
            if hand_down:
                lock.hand_down()
            yield lock
        finally:
            lock.release()

    def holder(self) -> dict[str, Any] | None:
        """Who runs in this folder now (host, pid, job id), or None when nobody does."""
        return RunLock(self.path / LOCK_FILE).holder()

    def launcher(self) -> dict[str, Any] | None:
        """The live launcher that holds this run in its queue (host, pid, and the job id once it starts the run's
        ranks: gptpar.run.queue), or None."""
        return RunLock(self.job_dir / QUEUE_LOCK).holder()


def completed(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the keys a later gptpar added at their defaults: a folder written before a key
    existed holds the same config as one that leaves the key at its default, so a requeue or a re-run sweep
    after an upgrade is not refused."""
    defaults = Config().to_dict()
    filled = {section: {**values, **(saved.get(section) or {})} if isinstance(saved.get(section, {}), dict)
              else saved[section] for section, values in defaults.items()}
    return {**filled, **{section: values for section, values in saved.items() if section not in defaults}}


def config_changes(old: dict[str, Any], new: dict[str, Any], ignore: Collection[str] = ()) -> list[str]:
    """`key: old -> new` for each key whose value differs between two config mappings, by key, `ignore`d keys left
    out."""
    flat_old, flat_new = _flatten(old), _flatten(new)
    keys = sorted(key for key in set(flat_old) | set(flat_new) if key not in ignore)
    return [f"{key}: {flat_old.get(key, '(unset)')!r} -> {flat_new.get(key, '(unset)')!r}"
            for key in keys if flat_old.get(key) != flat_new.get(key)]


def config_diff(old: dict[str, Any], new: dict[str, Any], limit: int = 4, ignore: Collection[str] = ()) -> str:
    """The keys whose values differ between two config mappings, as one short line."""
    changed = config_changes(old, new, ignore)
    shown = "; ".join(changed[:limit]) or "no key differs"
    return shown + (f"; and {len(changed) - limit} more" if len(changed) > limit else "")


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


def in_use(path: Path, holder: dict[str, Any]) -> str:
    """The one-line refusal of a live run folder, naming who holds it."""
    job = f" job {holder['job_id']}" if holder.get("job_id") else ""
    return (f"run folder {path} is in use by host {holder.get('host', '?')} pid {holder.get('pid', '?')}{job}; "
            "wait for it to end, or use another log.run_id")


def run_folder(runs_dir: str | Path, run_id: str, key: str = "log.run_id") -> RunFolder:
    """The folder of a run, which must lie inside the runs folder."""
    root = Path(runs_dir).resolve()
    path = (root / check_run_id(run_id, key)).resolve()
    if path.parent != root:
        raise GptparError(f"{key}: {run_id!r} would put the run outside {root}")
    return RunFolder(path)


def holds_run(path: Path) -> bool:
    """Whether a folder is a run's: it holds config.yaml or a rank log (a run started by hand may have no config)."""
    return (path / CONFIG_FILE).is_file() or any(RANK_FILE.fullmatch(p.name) for p in path.glob(RANK_GLOB))


def run_entry(path: str | Path) -> Path | None:
    """The run folder entry (RUN_ENTRIES, a rank log or its torn tail) that `path` is or lies inside, symlinks
    resolved, in whichever run folder holds it; None for a path no run reads. What a command that writes a file of
    the user's choosing checks first, so that it never writes over a run."""
    target = Path(path).resolve()
    for folder in target.parents:
        if holds_run(folder) or RunFolder(folder).holds_run():
            entry = folder / target.relative_to(folder).parts[0]
            if entry.name in RUN_ENTRIES or RANK_ENTRY.fullmatch(entry.name):
                return entry
    return None


def find_runs(runs_dir: str | Path) -> list[RunFolder]:
    """Every run folder (see holds_run) under runs_dir, at any depth."""
    root = Path(runs_dir)
    found = {p.parent for p in root.rglob(CONFIG_FILE)} | {
        p.parent for p in root.rglob(RANK_GLOB) if RANK_FILE.fullmatch(p.name)}
    return [RunFolder(p) for p in sorted(found) if p != root and p.name != "job"]


class RunLock:
    """flock on a file plus a heartbeat inside it (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._info: dict[str, Any] = {}
        self._adopted = False
        self._launcher: dict[str, Any] = {}  # an adopted lock's record before it was adopted

    def acquire(self, job_id: str = "", adopt: bool = False) -> None:
        """Take the lock, or refuse naming its holder; `adopt`: take over the one a launcher handed down, if any."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._adopted = adopt and (fd := self._handed_down()) is not None
        if not self._adopted:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        flocked = _try_flock(fd)
        info = _read_info(fd) if flocked is not None else _holders_record(fd)
        # A fresh heartbeat counts where flock cannot tell: no flock here, or the holder is on another node
        # of a filesystem whose flock is node-local. Our own host's stale record is a dead run's leftover.
        foreign = info.get("host") not in (None, socket.gethostname())
        if flocked is None or (_fresh(info) and (not flocked or foreign)):
            os.close(fd)
            raise GptparError(in_use(self.path.parent, info))
        self._fd = fd
        self._launcher = info if self._adopted else {}
        self._info = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id, "flock": flocked}
        self._write_heartbeat()
        self._beat = threading.Thread(target=self._heartbeat, name="gptpar-run-lock", daemon=True)
        self._beat.start()

    def hand_down(self) -> None:
        """Let the ranks this process starts (in it, or as children given `handed_fds`) take this lock over: its
        descriptor, named by LOCK_FD_ENV, shares the flock, which lasts while any of them keeps it open. The rank
        that adopts it records itself (the holder a refusal names and `gptpar cancel` interrupts) and beats on."""
        os.set_inheritable(self._fd, True)
        os.environ[LOCK_FD_ENV] = str(self._fd)

    def _handed_down(self) -> int | None:
        """A copy of the descriptor of this lock's file that a launcher handed down, or None: LOCK_FD_ENV unset, or
        naming a descriptor that is not this file's (another run's, or none: the variable outlived its launcher)."""
        try:
            fd = int(os.environ[LOCK_FD_ENV])
            mine, handed = os.stat(self.path), os.fstat(fd)
        except (KeyError, ValueError, OSError):
            return None
        return os.dup(fd) if (mine.st_dev, mine.st_ino) == (handed.st_dev, handed.st_ino) else None

    def relabel(self, job_id: str) -> None:
        """Record another job id in a lock this process holds, and since when (a queued run whose ranks now start)."""
        self._info.update(job_id=job_id, since=time.time())
        self._write_heartbeat()

    def _write_heartbeat(self) -> None:
        """Overwrite the record in place, padded to RECORD_BYTES (JSON allows trailing blanks): a reader never sees
        the empty file a truncate-then-write leaves between the two calls."""
        text = json.dumps({**self._info, "heartbeat": time.time()}).encode().ljust(RECORD_BYTES)
        os.pwrite(self._fd, text, 0)
        os.ftruncate(self._fd, len(text))

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if _read_info(self._fd).get("pid", os.getpid()) == os.getpid():  # else a rank took it over
                    self._write_heartbeat()
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._fd is not None:
            try:
                if os.environ.get(LOCK_FD_ENV) == str(self._fd):
                    del os.environ[LOCK_FD_ENV]
                if self._adopted:  # the lock is its launcher's again, to let go: its record goes back
                    self._info = self._launcher
                    self._write_heartbeat()
                else:
                    os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing the last descriptor of the file drops the flock
            self._fd = None

    def holder(self) -> dict[str, Any] | None:
        """The live holder's record, or None. A flock we can take means nobody holds it; where flock
        does not work (or the holder is on another host) a heartbeat younger than STALE_AFTER_S counts."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):  # no lock file, or no folder (a parent is a file)
            return None
        try:
            info = _read_info(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                flock_free = True
            except BlockingIOError:
                return _holders_record(fd) or {"host": "?", "pid": "?"}  # (re-read: `info` may precede its write)
            except OSError:
                flock_free = False
        finally:
            os.close(fd)
        if not info:
            return None
        same_host_with_flock = info.get("flock") and info.get("host") == socket.gethostname() and flock_free
        return info if _fresh(info) and not same_host_with_flock else None


def handed_fds() -> tuple[int, ...]:
    """The run lock's descriptor that a launcher hands down to the ranks it starts as processes (Popen's pass_fds)."""
    fd = os.environ.get(LOCK_FD_ENV, "")
    return (int(fd),) if fd.isdigit() else ()


def _read_info(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return {}


def _holders_record(fd: int) -> dict[str, Any]:
    """The record of the process whose flock refused us, waited for a moment: a holder that took the flock an
    instant ago has not written it yet, and a refusal should name it rather than "host ? pid ?"."""
    deadline = time.monotonic() + 2.0
    while not (info := _read_info(fd)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return info


def _fresh(info: dict[str, Any]) -> bool:
    """A heartbeat younger than STALE_AFTER_S: its writer was alive a moment ago."""
    try:
        return time.time() - float(info.get("heartbeat", 0)) < STALE_AFTER_S
    except (TypeError, ValueError):
        return False


def _try_flock(fd: int) -> bool | None:
    """True: we hold the flock. False: this filesystem has no working flock (the heartbeat decides).
    None: another process holds it (retried for a moment: a status check may hold it briefly)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        except OSError:  # ENOLCK / EOPNOTSUPP
            return False
