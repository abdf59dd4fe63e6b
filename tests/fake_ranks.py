"""A submitit task's training child for tests/launch/test_submitit_task.py: a real process, without torch, standing
in for `gptpar train` on every rank of a job. It begins each rank's log, sends its parent (the task) the signal a
scheduler would, waits for the task to pass a signal on, and after the rest of a step ends each rank as told:

    python fake_ranks.py RUN_DIR SIGNAL THEN OUTCOME [OUTCOME ...]

SIGNAL: USR2, TERM or INT. THEN: `linger` (alive after its final records, as a rank holding torch is while it tears
down, until the task ends it) or `exit`. One OUTCOME per rank: a final status (requeued, stopped, failed), or
`crash` (no final record; the process exits 1). A child that has no signal passed on within DEADLINE_S exits 3
without final records.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from logsets import Rank, config

FORWARDED = {signal.SIGUSR2, signal.SIGTERM, signal.SIGINT}  # the signals gptpar.launch.submitit_task passes on
STEP_S = 0.5  # the rest of the step the signal came in: the final records come this long after it, so a task that
# decided without waiting for them would decide on none (the tests pass whatever its value)
DEADLINE_S = 60.0  # a hang guard (a signal never passed on; a task that never ends the child): never a timing claim
NOT_SIGNALLED, CRASHED = 3, 1


def main(run_dir: str, sig: str, then: str, *outcomes: str) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # taken below by sigtimedwait, as a rank's handler takes it
    ranks = [Rank(Path(run_dir), r, config(dp=len(outcomes))).header(restart=1).step(1) for r in range(len(outcomes))]
    os.kill(os.getppid(), signal.Signals[f"SIG{sig}"])
    passed_on = signal.sigtimedwait(FORWARDED, DEADLINE_S)
    if passed_on is None:
        return NOT_SIGNALLED
    time.sleep(STEP_S)
    name = signal.Signals(passed_on.si_signo).name
    for rank, outcome in zip(ranks, outcomes, strict=True):
        if outcome == "failed":
            rank.final("failed", 1, error="RuntimeError: a rank's own error")
        elif outcome != "crash":
            rank.final(outcome, 1, signal=name)
    if "crash" in outcomes:
        return CRASHED
    if then == "linger":
        time.sleep(DEADLINE_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
