"""`gptpar train`'s one decision: is this process one rank of a job that srun, torchrun or gptpar started
(it trains here, on its config file alone), or the user's own command (it resolves the config as a
submitter does, then trains in this process or starts its ranks as local processes on this machine)?"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from gptpar.config import Config
from gptpar.launch import local
from gptpar.launch.backend import scheduler_state
from gptpar.launch.prepare import prepare_run
from gptpar.launch.status import completion
from gptpar.parallel.env import Layout
from gptpar.parallel.grid import world_size

TrainHere = Callable[[Config, bool], int]  # trains as this process's rank (with --reshape?); the exit code
# (gptpar.cli's _train_here)


def users_own_command(layout: Layout) -> bool:
    """No launcher, or a one-task SLURM step (an interactive `srun --pty bash`, or `srun -n1 gptpar train`):
    the user's command, whose config takes the user's defaults. A job's ranks train on their config file alone."""
    return layout.launcher == "single" or (layout.launcher == "slurm" and layout.world_size == 1)


def train_here_or_start_ranks(cfg: Config, layout: Layout, start_over: bool, train_here: TrainHere,
                              reshape: bool = False) -> int:
    """One rank of a launched job trains here (its rank 0 takes a --reshape's layout, as a submitter does). The user's
    own command is the submitter: it plans the run (--start-over sets an existing folder aside first; --reshape
    continues it on another layout), then trains in this process (one rank) or, asked for several ranks, starts them
    on this node and waits for them. It holds the run's lock from planning to the ranks' end (they take it over), so
    a start-over meanwhile is refused before the ranks exist."""
    one_task_step = users_own_command(layout) and layout.launcher == "slurm" and world_size(cfg) > 1
    if layout.launcher != "single" and not one_task_step:
        return train_here(cfg, reshape)
    with contextlib.ExitStack() as stack:  # held until the ranks have ended, then the run's state is read
        point = prepare_run(cfg, start_over=start_over, job_state=scheduler_state, stack=stack, reshape=reshape)
        ranks = world_size(point.cfg)
        if ranks == 1:
            if cfg.log.progress != "none":
                print(f"gptpar: training in this process: {point.folder.path}", flush=True)
            code = train_here(point.cfg, False)  # the plan above took the --reshape
        else:
            print(f"gptpar: {ranks} ranks as local processes on this machine: {point.folder.path}", flush=True)
            local.run_ranks(point, ranks)
    if ranks == 1:
        if code == 0 and cfg.log.progress != "none":
            print(completion(point.folder)[1], flush=True)
        return code
    state, line = completion(point.folder)
    print(line, flush=True)
    return 0 if state in ("completed", "diverged", "pending") else 1
