"""What every task of a submitit job runs (gptpar.launch.submitit_backend submits it): the rank entry point of
every backend, `gptpar train config.yaml` in the run folder, as a child process that reads its rank layout from
the task's environment (gptpar.parallel.env: SLURM_* under srun, SUBMITIT_LOCAL_* on submitit's local executor).

Why a child: at a time limit or a preemption, submitit's USR2 handler calls checkpoint() on rank 0 synchronously,
inside the signal handler, where training cannot stop cleanly (it may be inside an all-reduce). So the training
runs in the child and stops at a step boundary by gptpar's own path (a checkpoint, then a "requeued" or "stopped"
final record; gptpar.train.preemption): this task passes INT, TERM and USR2 on to it, and checkpoint() waits
until every rank has written its final record, then returns a resubmission of this same task, which resumes the
run from its folder with no step lost or repeated. submitit only requeues. (It does not wait for the child to
exit: a Python process holding torch takes seconds to tear down, minutes on a loaded node, and the time limit
does not wait; the requeue ends the child.)

The child runs in a session of its own, so a Ctrl-C on the terminal of the local executor reaches it once (from
this task), not twice (a second Ctrl-C stops a rank at once, without a checkpoint). A signal is passed on once
the child has begun its log (its handlers are in place by then; a USR2 during Python's start-up would kill it),
and its exit is watched with waitid(WNOWAIT), never Popen.poll: checkpoint() runs inside a signal handler,
possibly while the main loop is in the middle of a poll holding Popen's lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from submitit.helpers import Checkpointable, DelayedSubmission

from gptpar.launch.local import omp_threads
from gptpar.parallel.env import DUMP_SIGNAL, layout_from_env
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import read_new_records
from gptpar.run.rows import run_result

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
# The dump signal that a rank (or `gptpar debug`) sends every task of the job (gptpar.launchers.signal_job): SLURM
# delivers it to every process of the step, the child rank included (proctrack cgroup or linuxproc), so this task
# only must not die of it (SIGQUIT's default); passed on as well, the rank would dump twice, the second time after
# SIGCONT had let a stopped rank run on.
IGNORED = (DUMP_SIGNAL,)
POLL_S = 0.2


class RankTask(Checkpointable):
    """One run's rank on each task of its job. Pickled by submitit with its run folder and command only."""

    def __init__(self, run_dir: str, command: Sequence[str]) -> None:
        self.run_dir, self.command = run_dir, list(command)
        self._child: subprocess.Popen | None = None
        self._submitits_usr2: Any = None  # submitit's own USR2 handler, called after the signal is passed on
        self._logs: dict[Path, int] = {}  # each rank's log and the offset up to which this start's records were read
        self._finals: dict[Path, dict[str, Any]] = {}  # the final record each rank wrote in this start
        self._own_log: tuple[Path, int] | None = None  # this task's rank's log and its size before this start
        self._pending: list[int] = []  # signals received, not yet passed on to the child

    def __getstate__(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "command": self.command}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["run_dir"], state["command"])

    def __call__(self) -> dict[str, Any]:
        """Train this task's rank to its end; the run's result (gptpar.run.rows.run_result: a failed run
        raises, so that submitit reports the job failed)."""
        layout = layout_from_env(os.environ)
        env = {**os.environ, "OMP_NUM_THREADS": omp_threads(os.environ, layout.local_world_size)}
        folder = RunFolder(Path(self.run_dir))
        self._logs = {log: _size(log) for log in map(folder.rank_log, range(layout.world_size))}
        self._own_log = folder.rank_log(layout.rank), _size(folder.rank_log(layout.rank))
        self._submitits_usr2 = signal.getsignal(signal.SIGUSR2)
        previous = {sig: signal.signal(sig, self._pass_on) for sig in FORWARDED}
        previous.update((sig, signal.signal(sig, _not_for_this_task)) for sig in IGNORED)
        try:
            self._child = subprocess.Popen(self.command, cwd=self.run_dir, env=env, start_new_session=True)
            self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._child is not None:
                if self._exit_code() is None:  # this task is going down on an error of its own
                    self._child.kill()
                self._child.wait()
        return run_result(folder)

    def checkpoint(self) -> DelayedSubmission | None:
        """Rank 0, inside submitit's USR2 handler: the child was just sent USR2 (every rank stops at the next step
        boundary with a checkpoint); once every rank's final record is written (or the child has exited cleanly),
        resubmit this task. A failed rank or child is not resubmitted (None: submitit reports the job failed)."""
        code = self._wait(until_final=True)
        return super().checkpoint() if resubmits(code, self._finals.values()) else None

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append(signum)
        self._deliver()
        if signum == signal.SIGUSR2 and callable(self._submitits_usr2):
            self._submitits_usr2(signum, frame)  # on rank 0: checkpoint(), then the requeue

    def _deliver(self) -> None:
        """Pass the signals received on to the child once it has begun this start's log."""
        if self._child is None or self._exit_code() is not None or self._own_log is None:
            return
        log, size = self._own_log
        if self._pending and _size(log) > size:
            while self._pending:
                os.kill(self._child.pid, self._pending.pop(0))

    def _exit_code(self) -> int | None:
        """The child's exit code (negative: killed by that signal), None while it runs; it is left unreaped."""
        assert self._child is not None
        try:
            info = os.waitid(os.P_PID, self._child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped by Popen
            return self._child.returncode
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def _wait(self, until_final: bool = False) -> int | None:
        """Wait for the child to exit (or, `until_final`, for every rank's final record of this start); its exit
        code, None while it runs (or when none was started)."""
        if self._child is None:
            return None
        while (code := self._exit_code()) is None and not (until_final and self._all_final()):
            self._deliver()
            time.sleep(POLL_S)
        return code

    def _all_final(self) -> bool:
        """Whether every rank has written its final record in this start (read from where this start began)."""
        for log, offset in self._logs.items():
            if log not in self._finals:
                records, self._logs[log] = read_new_records(log, offset)
                self._finals.update((log, r) for r in records if r.get("kind") == "final")
        return len(self._finals) == len(self._logs)


def resubmits(code: int | None, finals: Iterable[Mapping[str, Any]]) -> bool:
    """Whether checkpoint() resubmits a job, given its child's exit code (None: still running, as a rank holding
    torch is while it tears down) and the final records its ranks wrote in this start: only if the child has not
    exited with an error or a signal and no rank failed. A failed run started again fails again, each time after
    a wait in the queue; submitit reports it failed instead."""
    return code in (None, 0) and not any(final.get("status") == "failed" for final in finals)


def _not_for_this_task(signum: int, frame: FrameType | None) -> None:
    """A handler, not SIG_IGN, which the child would inherit: the rank gets the signal from SLURM itself."""


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
