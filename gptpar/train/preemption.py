"""Stopping cooperatively at a step boundary on a signal: checkpoint-and-requeue on SLURM's warning
signal (USR2), checkpoint-and-stop on SIGTERM (what SLURM sends at `scancel` and at a time limit
without `--signal`) and on Ctrl-C (SIGINT).

Jobs ask SLURM for SIGUSR2 shortly before their time limit (`--signal=USR2@N`; USR1 belongs to
NCCL). A signal handler must not checkpoint by itself (it may fire mid all-reduce), so it only
records the signal; the trainer polls `stop_request()` at each step boundary, agrees across ranks
(a requeue wins over a stop), saves, logs a final "requeued" or "stopped" record and, for a requeue,
calls `requeue_current_job()` on rank 0. A second Ctrl-C raises KeyboardInterrupt at once. Before the trainer's
loop polls (`polled`), while the data and the model are prepared (minutes, for a large corpus), TERM and INT stop
the rank at once (StopBeforeTraining: a "stopped" final record at the step it started from, nothing to save).

A rank of gptpar's local launcher also stops so when the launcher is gone (`launcher_watch`): killed with
SIGKILL, it could not pass a signal on, and its ranks would otherwise train to the end unattended.

`scontrol requeue` reruns the job's script, i.e. `gptpar train config.yaml` in the same run folder,
which resumes from the checkpoint; a stopped run resumes the same way when it is started again. A rank of a
launcher that marks its tasks (gptpar/launchers.py: submitit, launch.launcher=submitit) only stops: the launcher's
own task requeues the job once the rank has exited (gptpar.launch.submitit_task).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

from gptpar.launchers import started_by
from gptpar.parallel.env import LAUNCHER_PID, layout_from_env

REQUEUE_SIGNAL = signal.SIGUSR2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SIGNALS = (REQUEUE_SIGNAL, *STOP_SIGNALS)
_received: dict[int, None] = {}  # the signals received since their handler was installed, in order
LAUNCHER_POLL_S = 0.5  # how often a local rank checks that its launcher still lives
_polled = False  # whether a trainer loop polls the requests (`polled`)


class StopBeforeTraining(KeyboardInterrupt):
    """A stop signal (TERM, INT) that arrived before the trainer polls for one: preparing the data or the model can
    take minutes in loops that reach no step boundary, and there is nothing to save yet, so the rank stops at once.
    A KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum).name
        super().__init__(f"{self.signal} before the first step")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT and signum in _received:
        raise KeyboardInterrupt("a second Ctrl-C: stopped at once, without a checkpoint")
    _received[signum] = None
    if signum in STOP_SIGNALS and not _polled:
        raise StopBeforeTraining(signum)


@contextmanager
def polled() -> Iterator[None]:
    """While the trainer's loop runs, polling `stop_request()` at each step boundary (and saving on the way out), a
    stop signal is only recorded; before it, the signal raises StopBeforeTraining."""
    global _polled
    _polled = True
    try:
        yield
    finally:
        _polled = False


def install_preemption_handler(signum: int | None = None) -> None:
    """Make `signum` (default: USR2, and TERM/INT too in a launched rank) request a graceful stop
    instead of killing the process.

    The CLI installs it before the slow imports and the trainer again (`stop_signals`); a second
    install keeps a request that arrived in between. A process that is not a rank (the one-process
    `gptpar train`, the local launcher while it plans) keeps Ctrl-C and TERM as they are until its
    trainer loop starts.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    launched = layout_from_env(os.environ).launcher != "single"  # a rank whose trainer will poll the request
    signums = (signum,) if signum is not None else SIGNALS if launched else (REQUEUE_SIGNAL,)
    for sig in signums:
        if signal.getsignal(sig) is not _on_signal:
            _received.pop(sig, None)
            signal.signal(sig, _on_signal)


@contextmanager
def stop_signals() -> Iterator[None]:
    """USR2, TERM and INT request a stop while the trainer runs; handlers that were not gptpar's come
    back afterwards (a trainer run inside a test leaves the test process as it found it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        install_preemption_handler(sig)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not _on_signal:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def launcher_watch(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """In a rank of gptpar's local launcher (and `stop_signals`), a thread that sends this rank SIGTERM once the
    launcher is gone, so it stops at the next step boundary with a checkpoint and a `stopped` record. It compares
    the parent pid with the launcher's: portable, unlike Linux's parent-death signal, which also fires when the
    launcher's spawning thread ends. Ranks of SLURM, torchrun or one process have no launcher of gptpar's to watch."""
    env = os.environ if env is None else env
    launcher = env.get(LAUNCHER_PID)
    if launcher is None or threading.current_thread() is not threading.main_thread():  # no handler off the main one
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(LAUNCHER_POLL_S):
            if os.getppid() != int(launcher):
                print(f"gptpar: rank {env.get('RANK')}: its launcher (pid {launcher}) is gone; stopping at the next "
                      "step boundary (as on SIGTERM)", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="gptpar-launcher-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()  # before `stop_signals` gives SIGTERM back: a late SIGTERM is still only a request


def preemption_requested() -> bool:
    return bool(_received)


def stop_request() -> tuple[str, str] | None:
    """("requeued", "SIGUSR2") once USR2 arrived, else ("stopped", the first of SIGTERM/SIGINT), else None."""
    if not _received:
        return None
    sig = REQUEUE_SIGNAL if REQUEUE_SIGNAL in _received else next(iter(_received))
    return ("requeued" if sig == REQUEUE_SIGNAL else "stopped"), signal.Signals(sig).name


def can_requeue(env: Mapping[str, str] | None = None) -> bool:
    """Only a SLURM job or the job of a launcher that marks its tasks (submitit, on SLURM or its local executor) can
    be requeued; elsewhere a requeue request is a stop."""
    env = os.environ if env is None else env
    return bool(env.get("SLURM_JOB_ID") or started_by(env))


def _is_rank_zero(env: Mapping[str, str]) -> bool:
    return env.get("RANK", env.get("SLURM_PROCID", "0")) == "0"


def requeue_current_job() -> bool:
    """Requeue this SLURM job (rank 0 only); False outside SLURM, on other ranks, and in the job of a launcher that
    marks its tasks (submitit's checkpoint() requeues the job once this rank has exited).

    The job must have been submitted with `--requeue`. SLURM kills the running job and starts it
    again (SLURM_RESTART_COUNT + 1) in the same run folder, where the trainer resumes.
    """
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id or not _is_rank_zero(env) or started_by(env):
        return False
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"gptpar: scontrol requeue {job_id} failed: {result.stderr.strip()}", file=sys.stderr)
        return False
    return True
