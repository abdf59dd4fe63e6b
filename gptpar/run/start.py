"""Starting a run in its folder: the run named (once), or named by the folder its config file sits in, the folder
made, its config.yaml written (checked against the run's own by gptpar.run.resume), and an old folder set aside to
start over. The submit side (gptpar.launch.prepare) does all of it before any rank starts; a rank started without a
submit side only names its run here too (gptpar.run.claim)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from gptpar.config import Config, Layer, nested, updated
from gptpar.errors import GptparError
from gptpar.run.folder import LOCK_FILE, RunFolder, in_use, run_folder
from gptpar.run.names import job_run_id, numbered, numbered_run_id, replaced_name
from gptpar.run.resume import check_start
from gptpar.run.state import LIVE_JOB_STATES, check_checkpoint, read_run

START_OVER = "pass --start-over to set the old folder aside and start over"  # how a refused folder starts over
JobState = Callable[[RunFolder], "str | None"]  # the scheduler's word on a folder's job (backend.scheduler_state)


def named_run(cfg: Config, run_id: str = "", runs_dir: str | Path | None = None, key: str = "log.run_id",
              prefix: str = "", reserve: bool = True) -> tuple[Config, RunFolder]:
    """A run's config with its id, and its folder under `runs_dir` (by default log.runs_dir). The id is
    `run_id` (a sweep point's, or the one rank 0 chose), else log.run_id, else derived here: the one place a
    run is named, so a run id is derived once per run. A derived id is `<log.name>-<job id>` inside a SLURM job, else
    `<prefix or log.name>.N` (next_run_id; `reserve`: False to name it without making its folder, as --dry-run
    does). `key` names the id's origin in a refusal."""
    root = runs_dir or cfg.log.runs_dir
    name = run_id or cfg.log.run_id or job_run_id(cfg.log.name) or next_run_id(root, prefix or cfg.log.name, reserve)
    folder = run_folder(root, name, key)
    return updated(cfg, {"log.run_id": folder.name}), folder


def next_run_id(runs_dir: str | Path, name: str, reserve: bool = True) -> str:
    """`NAME.N`, N one above every run of that name under runs_dir (those set aside too); with `reserve` its folder is
    made at once (reserved_run_id)."""
    root = Path(runs_dir)
    pattern = numbered(name)
    taken = [int(m[1]) for p in (root.iterdir() if root.is_dir() else ()) if (m := pattern.fullmatch(p.name))]
    number = max(taken, default=0) + 1
    return reserved_run_id(root, name, number) if reserve else numbered_run_id(name, number)


def reserved_run_id(root: Path, name: str, number: int) -> str:
    """`NAME.N` for the first N from `number` whose folder this process makes: mkdir fails where another process made
    it first (it named its run in the same moment), and that one keeps the number."""
    make_folder(root)
    while True:
        try:
            (root / numbered_run_id(name, number)).mkdir()
            return numbered_run_id(name, number)
        except FileExistsError:
            number += 1


def location_layer(config_file: str | Path) -> list[Layer]:
    """A config file in a folder that holds a run names that run: the folder is where the run is now (moved or
    copied), whatever log.runs_dir and log.run_id the file recorded. A config file elsewhere names none."""
    folder = RunFolder(Path(config_file).resolve().parent)
    if not folder.holds_run():
        return []
    return [(f"run folder {folder.path}", nested({"log.runs_dir": str(folder.path.parent), "log.run_id": folder.name}))]


def write_folder(folder: RunFolder, cfg: Config, start_over: bool = False, job_state: JobState | None = None,
                 again: str = START_OVER, stack: contextlib.ExitStack | None = None, reshape: bool = False) -> None:
    """Make a run's folder and write its config.yaml. A live folder is refused naming its holder; a folder whose
    run has another config is refused with what changed (gptpar.run.resume; `again` says how to start over),
    unless `start_over`, which first moves any existing folder aside (set_aside); `reshape` lets it continue on another
    layout. The check, the move and the write
    are one step under the run's lock; with `stack` (a launcher that starts the ranks) the lock stays held, and is
    handed down to the ranks, until the stack closes: the run is live from here, before its ranks exist."""
    holder = folder.holder()
    if holder is not None:
        raise GptparError(in_use(folder.path, holder))
    with contextlib.ExitStack() as held:
        make_folder(folder.path)
        lock = held.enter_context(folder.hold(hand_down=stack is not None))
        if start_over and any(p.name != LOCK_FILE for p in folder.path.iterdir()):
            _move_aside(folder, job_state)  # the lock moves with it: held until the new folder's is
            make_folder(folder.path)
            held.enter_context(folder.hold(hand_down=stack is not None))
            lock.release()
        if folder.rank_logs():
            check_checkpoint(read_run(folder, held=True), again)
        check_start(folder, cfg, again=again, reshape=reshape)
        if stack is not None:
            stack.enter_context(held.pop_all())


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
    with folder.hold():  # refuses a live folder, naming its holder; the lock moves with the folder
        return _move_aside(folder, job_state)


def _move_aside(folder: RunFolder, job_state: JobState | None) -> Path:
    """set_aside's move, under the folder's lock held by the caller."""
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
    try:
        os.rename(folder.path, target)
    except OSError as exc:
        raise GptparError(f"cannot set run folder {folder.path} aside as {target.name}: "
                          f"{exc.strerror or exc}") from None
    return target
