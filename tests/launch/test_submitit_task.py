"""The submitit task's requeue path (gptpar.launch.submitit_task) without SLURM: whether a job stopped by USR2 is
resubmitted, given its ranks' final records and its child's exit (fast); then (slow) the task itself, run in this
process with submitit's own USR2 handler, over a real child (tests/fake_ranks.py) that writes every rank's records
and stops on the signals the task passes on. A local executor job requeued through it is in test_submitit.py."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from logsets import Rank, config
from submitit.core.job_environment import SignalHandler
from submitit.core.utils import DelayedSubmission, JobPaths, UncompletedJobError
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, LocalJobEnvironment

from gptpar.launch.submitit_task import RankTask, resubmits
from gptpar.run.logfile import read_rank_log

FAKE_RANKS = Path(__file__).resolve().parents[1] / "fake_ranks.py"
REQUEUED = {"status": "requeued", "signal": "SIGUSR2"}
FAILED = {"status": "failed", "error": "RuntimeError: x"}
JOB_ID = "7"


def test_a_job_is_resubmitted_only_if_no_rank_failed_and_its_child_did_not_fail() -> None:
    """A failed run started again fails again, after a wait in the queue each time: never resubmitted."""
    assert resubmits(None, [REQUEUED, REQUEUED])  # the child still tearing down, every rank stopped resumable
    assert resubmits(0, [REQUEUED, {"status": "stopped", "signal": "SIGTERM"}])
    assert resubmits(0, [])  # exited cleanly before its records were read: nothing says it failed
    assert not resubmits(None, [REQUEUED, FAILED])  # one failed rank is enough, whatever the others say
    assert not resubmits(0, [FAILED])
    assert not resubmits(1, [REQUEUED, REQUEUED])  # the child failed after its records (or without any)
    assert not resubmits(-signal.SIGKILL, [REQUEUED])


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as rank 0 of a 2-task job of submitit's local executor (the variables its tasks get)."""
    for name, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": JOB_ID, "SUBMITIT_LOCAL_NTASKS": "2",
                        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_GLOBALID": "0",
                        "SUBMITIT_LOCAL_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "job"
    path.mkdir()
    return path


def _task(run: Path, sig: str, then: str, *outcomes: str) -> RankTask:
    """The task of run folder `run` (made, as submission makes it), its child tests/fake_ranks.py."""
    run.mkdir(exist_ok=True)
    return RankTask(str(run), [sys.executable, str(FAKE_RANKS), str(run), sig, then, *outcomes])


def _paths(job_dir: Path) -> JobPaths:
    return JobPaths(job_dir, job_id=JOB_ID, task_id=0)


def _run_as_submitit_does(task: RankTask, job_dir: Path) -> dict:
    """The task on rank 0 with USR2 handled as submitit handles it there (SignalHandler.checkpoint_and_try_requeue,
    installed before the task runs): the task's checkpoint(), then a requeue (the local executor's: exit 144, the
    resubmission pickled in place of the job's) or, when checkpoint() returns None, UncompletedJobError."""
    delayed = DelayedSubmission(task)
    delayed.set_timeout(60, 3)
    handler = SignalHandler(LocalJobEnvironment(), _paths(job_dir), delayed)
    previous = signal.signal(signal.SIGUSR2, handler.checkpoint_and_try_requeue)
    try:
        return task()
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.slow
def test_a_preempted_job_whose_ranks_stopped_resumable_is_resubmitted(tmp_path: Path, job_dir: Path) -> None:
    """USR2 reaches the child through the task; once both ranks' final records say requeued (the child still
    alive), checkpoint() resubmits this same task. A failed final record of an earlier start does not count."""
    run = tmp_path / "run"
    Rank(run, 1, config(dp=2)).header().step(1).final("failed", 1, error="RuntimeError: a start before")
    task = _task(run, "USR2", "linger", "requeued", "requeued")
    with pytest.raises(SystemExit) as requeued:
        _run_as_submitit_does(task, job_dir)
    assert requeued.value.code == LOCAL_REQUEUE_RETURN_CODE
    resubmitted = DelayedSubmission.load(_paths(job_dir).submitted_pickle).function
    assert isinstance(resubmitted, RankTask) and (resubmitted.run_dir, resubmitted.command) == (task.run_dir,
                                                                                                task.command)
    assert task._child.returncode == -signal.SIGKILL  # the requeue ended it: checkpoint() did not wait for its exit
    assert [_last_final(run, r)["signal"] for r in (0, 1)] == ["SIGUSR2", "SIGUSR2"]  # what the child was passed


@pytest.mark.slow
@pytest.mark.parametrize(("then", "outcomes"), [("linger", ("requeued", "failed")), ("exit", ("requeued", "crash"))],
                         ids=["a-rank-failed", "the-child-crashed"])
def test_a_preempted_job_with_a_failed_rank_is_never_resubmitted(tmp_path: Path, job_dir: Path, then: str,
                                                                 outcomes: tuple[str, ...]) -> None:
    """Rank 1 fails in the step the signal came in (its final record comes fake_ranks.STEP_S after the signal:
    checkpoint() must wait for it), or the child exits 1, rank 1 without a final record: no resubmission, and
    submitit reports the job failed."""
    with pytest.raises(UncompletedJobError, match="checkpoint function returned None"):
        _run_as_submitit_does(_task(tmp_path / "run", "USR2", then, *outcomes), job_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_term_and_int_reach_the_child_which_stops_and_the_task_returns_the_run(tmp_path: Path, job_dir: Path,
                                                                              sig: str) -> None:
    """TERM (scancel; the local executor's cancel) and INT (Ctrl-C) are passed on too, without a checkpoint() call:
    the ranks stop, the child exits and the task returns the run's result."""
    run = tmp_path / "run"
    result = _run_as_submitit_does(_task(run, sig, "exit", "stopped", "stopped"), job_dir)
    assert (result["state"], result["final"]["signal"]) == ("stopped", f"SIG{sig}")
    assert _last_final(run, 1)["signal"] == f"SIG{sig}"


def _last_final(run: Path, rank: int) -> dict:
    final = read_rank_log(run / f"rank{rank}.jsonl").final
    assert final is not None
    return final
