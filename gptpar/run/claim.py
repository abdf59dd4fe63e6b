"""A rank's claim on its run folder, before it trains: rank 0 takes the folder's lock (its launcher's, where one holds
it for the ranks), checks its config against the run's own and writes config.yaml (gptpar.run.resume: a restart runs
the config it was trained with), reads the run's state and checks that a resumed run still has its checkpoint; every
rank learns the outcome, so none writes into a folder that rank 0 refused. A run that a submit side planned arrives
named; only ranks started without one (torchrun or srun directly on a config file with no log.run_id) have rank 0
name it here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from gptpar.config import Config
from gptpar.errors import GptparError
from gptpar.parallel.env import Layout
from gptpar.run.folder import RunFolder, run_folder
from gptpar.run.resume import check_start
from gptpar.run.start import named_run
from gptpar.run.state import FINISHED, check_checkpoint, read_run

AGAIN = "move the old folder away to start over"  # how a rank's refused start starts over (no --start-over here)
Share = Callable[[list[Any]], None]  # makes rank 0's list every rank's, in place (a broadcast in the group)


def claim_run_folder(cfg: Config, launched: Config, layout: Layout, share: Share, stack: contextlib.ExitStack,
                     job_id: str = "", reshape: bool = False) -> tuple[RunFolder, str]:
    """Claim the run's folder for this start (`cfg`: its config file; `launched`: the config the ranks run, with the
    launcher's world size); the lock (recording `job_id`) is held until `stack` closes, unless the run is already
    finished. `share` is the group's broadcast, passed in so that the run/ package never imports torch. Returns the
    folder (its name is the run id) and the run's state before this start."""
    answer: list[Any] = [None, None, None]
    if layout.rank == 0:
        try:
            named, folder = named_run(cfg)
            lock = stack.enter_context(folder.hold(job_id, adopt=True))  # the launcher's, where it handed one down
            run = read_run(folder, held=True) if folder.rank_logs() else None
            if run is not None:
                check_checkpoint(run, AGAIN)
            check_start(folder, named, named_run(launched, folder.name)[0], AGAIN, reshape)
            state = run.state if run is not None else "new"
            if state in FINISHED:
                lock.release()
            answer = [folder.name, state, None]
        except GptparError as exc:
            answer = [None, None, str(exc)]
    if layout.world_size > 1:
        share(answer)
    run_id, state, error = answer
    if error is not None:
        raise GptparError(error if layout.rank == 0 else f"rank 0 refused the run folder: {error}")
    return run_folder(cfg.log.runs_dir, run_id), state
