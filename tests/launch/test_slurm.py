"""End to end on the real local SLURM cluster (make cluster-up NODES=2 GPUS_PER_NODE=2).

Every job is submitted at once by a module fixture and checked on its outputs: SLURM/run state,
a log from every rank, the requeue continuing without a lost or repeated step, and figures; through
gptpar's sbatch script and through submitit (launch.launcher=submitit) alike.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import command_words

from gptpar import api
from gptpar.launch.backend import scheduler_state
from gptpar.launch.slurm import clean_env, job_info, slurm_reachable
from gptpar.run.folder import RunFolder
from gptpar.run.state import LIVE_JOB_STATES, read_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(not slurm_reachable(), reason="no SLURM cluster answers sinfo (make cluster-up)")]

REPO = Path(__file__).resolve().parents[2]
GPTPAR = str(REPO / ".venv" / "bin" / "gptpar")
TINY = ["model.preset=gpt2-tiny", "data.source=synthetic", "data.tokenizer=bytes", "data.seq_len=32",
        "data.synthetic_tokens=20000", "train.batch_size=8", "train.max_steps=3", "train.eval_every=0",
        "train.eval_batches=1", "train.threads=1", "launch.time=00:05:00"]
REQUEUE_STEPS = 60  # below the 70-step epoch of the 20000-token synthetic corpus
# slurmctld checks time limits every 30 s and sends USR2 at the first check that finds the limit less than
# launch.signal_s + 30 s away: with a 1-minute limit and launch.signal_s=20, 10 to 40 s after the job starts. Not
# sooner: a USR2 sent before the job's srun step exists (a check within a second of the start; backfill starts jobs
# just before it, when both run every 30 s) reaches nobody, and the job dies at its limit. LIMIT_STEPS is 1.7 times
# what one process trains in those 40 s, its start-up (7 s) aside, on an idle machine (3.5 steps/s), so that the
# first round always ends with a requeue.
LIMIT_STEPS = 200
LIMIT = ["data.seq_len=64", "train.batch_size=16", "train.epochs=1000", f"train.max_steps={LIMIT_STEPS}",
         "launch.time=00:01:00", "launch.signal_s=20"]
RAISED_LIMIT_MIN = 5  # after the first real limit, the time limit the requeued job finishes under
FOREVER = ["train.epochs=1000", "train.max_steps=1000000"]  # until cancelled
SUBMITIT = "launch.launcher=submitit"
# sbatch takes SBATCH_TIMELIMIT over the script's --time; beyond the partitions' 2-day limit, SLURM keeps the job
# pending (Reason=PartitionConfig here) until its limit is lowered: a job that cannot start before the test lets it.
UNSTARTABLE = ("SBATCH_TIMELIMIT", "3-00:00:00")
INTERACTIVE: list[subprocess.Popen] = []  # the fixture's `srun ... gptpar train`, until its test waits for it


def run_state(run: Path) -> str:
    """What `gptpar status` says: the run's records and lock, plus SLURM's word on its job."""
    folder = RunFolder(run)
    return read_run(folder, scheduler=scheduler_state(folder)).state


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def read_job_record(run: Path) -> dict[str, str]:
    return RunFolder(run).read_job_record()


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    cmd = command_words(cmd)  # LIMIT's keys replace TINY's: a command line takes each key once
    result = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _wait(run_dir: Path, timeout_s: float = 300) -> str:
    """Poll the run's state until it leaves pending/running (bounded: a stuck job fails the test)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = run_state(run_dir)
        if state not in LIVE_JOB_STATES:
            return state
        time.sleep(1)
    raise AssertionError(f"{run_dir} still {run_state(run_dir)} after {timeout_s} s")


def _release(job_id: str) -> None:
    """SLURM holds a requeued job for ~2 minutes (BeginTime); start it sooner so the test stays short,
    but not at once: a restart before the node has cleaned up is killed ("Job credential revoked")."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+5"], check=True, env=clean_env())


def _ranks(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("rank")) for p in run_dir.glob("rank*.jsonl"))


def _final(run_dir: Path, rank: int = 0) -> dict:
    return [r for r in read_records(run_dir / f"rank{rank}.jsonl") if r["kind"] == "final"][-1]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Submit every scenario up front, so the cluster runs them side by side. SLURM starts them in this order: the
    two-node jobs first (each takes every GPU, so nothing runs beside them), then the time-limit jobs (the longest:
    several rounds), then the rest; the jobs that train until cancelled last, so they burn no CPU before their
    tests cancel them."""
    work = tmp_path_factory.mktemp("slurm-e2e", numbered=True)
    runs = work / "runs"
    common = [*TINY, f"log.runs_dir={runs}"]
    _run([GPTPAR, "submit", "pp", "--gpus", "2", "--nodes", "2", *common, "launch.partition=GPU", "parallel.pp=2",
          "parallel.chunks=2", "log.run_id=pp_engine_2nodes"], work)
    _run([GPTPAR, "submit", "dp", "--gpus", "2", "--nodes", "2", *common, "launch.partition=GPU", "parallel.tp=2",
          "parallel.sequence_parallel=true", "parallel.loss_parallel=true", "log.run_id=tp_2nodes"], work)
    _run([GPTPAR, "submit", "dp", "--gpus", "2", "--nodes", "2", *common, "launch.partition=GPU", SUBMITIT,
          "log.run_id=submitit_dp_2nodes"], work)
    _run([GPTPAR, "submit", "dp", "--gpus", "1", *common, *LIMIT, "log.run_id=limit"], work)
    _run([GPTPAR, "submit", "dp", "--gpus", "1", *common, *LIMIT, SUBMITIT, "log.run_id=submitit_limit"], work)
    for limit in (runs / "limit", runs / "submitit_limit"):  # each goes round while the other tests run
        threading.Thread(target=_release_requeues_until_done, args=(read_job_record(limit)["job_id"], limit),
                         daemon=True).start()
    _run([GPTPAR, "submit", "dp", "--gpus", "1", *common, f"train.max_steps={REQUEUE_STEPS}",
          "train.checkpoint_every=0", "log.run_id=requeue"], work)
    _run(["make", "-f", str(REPO / "jobs" / "Makefile.launch"), "submit-dp", "GPUS=2", f"VENV={REPO / '.venv'}",
          f"ARGS={' '.join([*common, 'log.run_id=dp2'])}"], REPO)
    env = {**clean_env(), "VENV": str(REPO / ".venv"), "RUNS": str(runs), "OVERRIDES": " ".join(TINY)}
    # The script asks for Bridges-2's 5 CPUs per GPU; the local nodes have 2, and a command-line option
    # overrides the script's own.
    (work / "jobs" / "logs").mkdir(parents=True)  # where the plain scripts' own output goes, as in a checkout
    pp_job = _run(["sbatch", "--parsable", "--cpus-per-task=1", str(REPO / "jobs" / "pp.sbatch")], work, env).strip()
    (work / "pp_job").write_text(pp_job)
    _run([GPTPAR, "sweep", str(REPO / "sweeps" / "ci_small.yaml"), "--runs-dir", str(runs)], work)
    _run([GPTPAR, "sweep", str(REPO / "sweeps" / "ci_small.yaml"), "--runs-dir", str(work / "submitit_runs"),
          SUBMITIT], work)
    array = read_job_record(work / "submitit_runs" / "ci_small" / "parallel.dp_sync=naive,train.lr=0.001")
    (work / "submitit_array").write_text(str(job_info(array["job_id"].split("_")[0])))
    _submit_from_a_clone_then_edit_it(work, common)
    # Inside `srun --pty bash` (one task), `gptpar train parallel.dp=2` starts its two ranks on the node.
    with (work / "interactive.out").open("w") as out:
        INTERACTIVE.append(subprocess.Popen(["srun", "-p", "GPU-shared", "-n1", "--gres=gpu:2", "--time=5", GPTPAR,
                                             "train", *common, "parallel.dp=2", "log.run_id=interactive"], cwd=work,
                                            env=clean_env(), stdout=out, stderr=subprocess.STDOUT))
    _run([GPTPAR, "submit", "dp", "--gpus", "2", *common, *FOREVER, SUBMITIT, "log.run_id=submitit_cancelled"], work)
    _run([GPTPAR, "submit", "dp", "--gpus", "1", *common, *FOREVER, "log.run_id=cancelled"], work)
    yield work
    for srun in INTERACTIVE:  # left running by a test that failed before it waited for it
        srun.kill()
        srun.wait()


def _submit_from_a_clone_then_edit_it(work: Path, common: list[str]) -> None:
    """Submit a submitit job that cannot start yet (UNSTARTABLE) from a git clone of the package; break the clone
    while the job waits, then let it start. A job that ran the clone instead of its snapshot would fail at once."""
    clone = work / "clone"
    for name in _run(["git", "ls-files", "--", "gptpar"], REPO).split():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, clone / name)
    git = ["git", "-C", str(clone), "-c", "user.name=gptpar", "-c", "user.email=gptpar@localhost"]
    _run([*git, "init", "-q"], clone)
    _run([*git, "add", "."], clone)
    _run([*git, "commit", "-qm", "submitted"], clone)
    (work / "clone_commit").write_text(_run([*git, "rev-parse", "HEAD"], clone).strip())
    code = (f"from gptpar import api; print(api.submit('dp', gpus=1, overrides={[*common, SUBMITIT]!r} + "
            "['log.run_id=submitit_snapshot']).job_id)")
    env = {**clean_env(), "PYTHONPATH": str(clone), UNSTARTABLE[0]: UNSTARTABLE[1]}
    job_id = _run([str(REPO / ".venv" / "bin" / "python"), "-c", code], work, env).split()[-1]
    (work / "snapshot_held").write_text(str(job_info(job_id)))
    (clone / "gptpar" / "train" / "entry.py").write_text("raise SystemExit('the edited checkout ran')\n")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=00:05:00"], check=True, env=clean_env())


def test_requeue_continues_without_lost_or_repeated_steps(work: Path) -> None:
    """First, so the signal lands while the job is still training."""
    run = work / "runs" / "requeue"
    job_id = read_job_record(run)["job_id"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(r["kind"] == "step" for r in read_records(run / "rank0.jsonl")):
        time.sleep(0.2)
    # The same USR2 that --signal=USR2@N sends to every task before the time limit, sent now.
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env=clean_env())
    while time.monotonic() < deadline:
        info = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              env=clean_env()).stdout
        if "JobState=PENDING" in info and "Restarts=1" in info:
            break
        time.sleep(0.5)
    _release(job_id)
    assert _wait(run) == "completed"
    records = read_records(run / "rank0.jsonl")
    headers = [r for r in records if r["kind"] == "header"]
    finals = [(r["status"], r["step"]) for r in records if r["kind"] == "final"]
    assert [h["restart"] for h in headers] == [0, 1]
    assert [f[0] for f in finals] == ["requeued", "completed"]
    assert 0 < finals[0][1] < REQUEUE_STEPS == finals[1][1]  # stopped mid-run, finished after restart
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, REQUEUE_STEPS + 1))  # none lost, none repeated


def test_gptpar_cancel_stops_a_submitit_job_at_a_step_boundary(work: Path) -> None:
    """Second, so the job does not hold its GPU long: SLURM's TERM reaches the task, which passes it on to its rank
    (it stops at a step boundary, checkpointed, and says so)."""
    runs, run = work / "runs", work / "runs" / "submitit_cancelled"
    deadline = time.monotonic() + 300
    while not any(r["kind"] == "step" for r in read_records(run / "rank0.jsonl")):
        assert time.monotonic() < deadline, "the job never logged a step"
        time.sleep(0.5)
    out = _run([GPTPAR, "cancel", "submitit_cancelled", "--runs-dir", str(runs)], work)
    assert out.startswith(f"{run}: cancelled SLURM job ")
    assert out.rstrip().endswith(f"(running); `gptpar submit dp {run / 'config.yaml'}` resumes it from its checkpoint")
    assert _wait(run) == "stopped"
    assert _final(run)["signal"] == "SIGTERM" and read_job_record(run)["backend"] == "submitit"


def test_gptpar_cancel_stops_a_running_slurm_job_at_a_step_boundary(work: Path) -> None:
    """`gptpar cancel` scancels the run's job; SLURM's TERM reaches the rank, which stops at a step boundary and
    says so; a second cancel finds nothing to cancel."""
    runs, run = work / "runs", work / "runs" / "cancelled"
    deadline = time.monotonic() + 300
    while not any(r["kind"] == "step" for r in read_records(run / "rank0.jsonl")):
        assert time.monotonic() < deadline, "the job never logged a step"
        time.sleep(0.5)
    out = _run([GPTPAR, "cancel", "cancelled", "--runs-dir", str(runs)], work)
    assert out.startswith(f"{run}: cancelled SLURM job ")
    assert out.rstrip().endswith(f"(running); `gptpar submit dp {run / 'config.yaml'}` resumes it from its checkpoint")
    assert _wait(run) == "stopped"
    assert _final(run)["signal"] == "SIGTERM"
    again = _run([GPTPAR, "cancel", str(run)], work)
    assert again.startswith(f"{run}: nothing to cancel: SLURM job ")


def test_a_submitit_job_under_a_real_time_limit_requeues_through_checkpoint_until_done(work: Path) -> None:
    """USR2 launch.signal_s before the 1-minute limit: the rank stops at a step boundary with a checkpoint, then
    submitit's handler calls the task's checkpoint(), which resubmits it, and submitit requeues the job; round
    after round until training is done, every step logged exactly once."""
    run = work / "runs" / "submitit_limit"
    job_id = read_job_record(run)["job_id"]
    assert _wait(run, 550) == "completed"  # the fixture's thread releases each requeue
    records = read_records(run / "rank0.jsonl")
    restarts = [r["restart"] for r in records if r["kind"] == "header"]
    assert len(restarts) >= 2 and restarts == list(range(len(restarts)))
    assert [r["status"] for r in records if r["kind"] == "final"] == ["requeued"] * (len(restarts) - 1) + ["completed"]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, LIMIT_STEPS + 1))
    submitit_log = "".join(p.read_text() for p in (run / "job").glob(f"{job_id}_0_log.*"))
    assert submitit_log.count("Calling checkpoint method.") == len(restarts) - 1
    assert submitit_log.count(f"Requeued job {job_id}") == len(restarts) - 1


def test_submitit_runs_data_parallel_across_two_nodes(work: Path) -> None:
    run = work / "runs" / "submitit_dp_2nodes"
    assert _wait(run) == "completed"
    assert _ranks(run) == [0, 1, 2, 3]
    headers = [read_records(run / f"rank{r}.jsonl")[0] for r in range(4)]
    assert [(h["launcher"], h["slurm"]["node"], h["slurm"]["job_nodelist"]) for h in headers] == [
        ("submitit", "node1", "node[1-2]"), ("submitit", "node1", "node[1-2]"), ("submitit", "node2", "node[1-2]"),
        ("submitit", "node2", "node[1-2]")]
    steps = {(s["step"], s["global_loss"]) for r in range(4) for s in read_records(run / f"rank{r}.jsonl")
             if s["kind"] == "step"}
    assert sorted(step for step, _ in steps) == [1, 2, 3]  # one loss for the job at each step


def test_a_submitit_sweep_is_one_array_running_max_concurrent_points_at_a_time(work: Path) -> None:
    sweep = work / "submitit_runs" / "ci_small"
    points = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name != "_jobs")
    assert len(points) == 4
    assert [_wait(p) for p in points] == ["completed"] * 4
    jobs = [read_job_record(p) for p in points]
    assert {j["backend"] for j in jobs} == {"submitit"} and len({j["job_id"].split("_")[0] for j in jobs}) == 1
    assert "'ArrayTaskThrottle': '2'" in (work / "submitit_array").read_text()  # ci_small's launch.max_concurrent


def test_a_submitit_job_runs_the_code_it_was_submitted_with(work: Path) -> None:
    """The checkout was edited (broken) while the job waited in the queue; the job ran its snapshot, and its
    header names the commit the snapshot was taken at, clean."""
    run = work / "runs" / "submitit_snapshot"
    waiting = (work / "snapshot_held").read_text()  # when the clone was edited
    assert "'JobState': 'PENDING'" in waiting and "'TimeLimit': '3-00:00:00'" in waiting
    assert _wait(run) == "completed"
    header = read_records(run / "rank0.jsonl")[0]
    commit = (work / "clone_commit").read_text()
    assert header["code_snapshot"]["commit"] == header["git_commit"] == commit
    assert header["code_snapshot"]["dirty"] is False and Path(header["code_snapshot"]["path"]).parent == run / "job"
    assert (work / "clone" / "gptpar" / "train" / "entry.py").read_text().startswith("raise SystemExit")


def test_sbatch_account_and_user_defaults_reach_a_submitit_job_and_wait_returns_once_it_is_cancelled_pending(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = work / "user-defaults.yaml"
    defaults.write_text("launch:\n  cpus_per_task: 2\n")
    monkeypatch.setenv("GPTPAR_USER_CONFIG", str(defaults))
    monkeypatch.setenv("SBATCH_ACCOUNT", "from-sbatch-account")
    monkeypatch.setenv(*UNSTARTABLE)
    job = api.submit("dp", gpus=1, overrides=[*TINY, f"log.runs_dir={work / 'runs'}", "log.run_id=submitit_held",
                                              SUBMITIT])
    info = job_info(job.job_id)
    assert (info["Account"], info["CPUs/Task"], info["JobState"], info["TimeLimit"]) == (
        "from-sbatch-account", "2", "PENDING", UNSTARTABLE[1])
    assert job.state() == "pending"
    # SLURM's reason once its scheduler has looked at the job: a limit above the partition's never clears by waiting.
    deadline, detail = time.monotonic() + 30, ""
    while time.monotonic() < deadline and not detail.startswith("will never start"):
        detail = read_run(RunFolder(job.run_dir), scheduler=scheduler_state(RunFolder(job.run_dir))).detail
        time.sleep(0.5)
    # SLURM gives either reason for a limit above MaxTime, depending on which of its passes looked at the job first.
    assert detail in ("will never start: PartitionConfig; the job asks for more than the partition's nodes or limits "
                      "allow (CPUs, GPUs, memory, nodes or time); lower --gpus, --nodes, launch.cpus_per_task or "
                      "launch.time, or use another partition",
                      "will never start: PartitionTimeLimit; launch.time is above the partition's time limit; lower it")
    resumes = f"`gptpar submit dp {job.run_dir / 'config.yaml'}` resumes it from its checkpoint"
    assert job.cancel() == f"cancelled SLURM job {job.job_id} (pending); {resumes}"
    assert job.wait(timeout=60) == "cancelled"  # SLURM says CANCELLED; it never started, and is not failed
    # The same API hands a job to gptpar's sbatch script just as well.
    job = api.submit("dp", gpus=1, overrides=[*TINY, f"log.runs_dir={work / 'runs'}", "log.run_id=sbatch_held"])
    assert job.submitit is None and job_info(job.job_id)["Account"] == "from-sbatch-account"
    resumes = f"`gptpar submit dp {job.run_dir / 'config.yaml'}` resumes it from its checkpoint"
    assert (job.state(), job.cancel(), job.wait(timeout=60)) == (
        "pending", f"cancelled SLURM job {job.job_id} (pending); {resumes}", "cancelled")


@pytest.mark.parametrize("launcher", ["sbatch", SUBMITIT])
def test_a_shape_no_node_can_hold_is_refused_before_the_queue(tmp_path: Path, launcher: str) -> None:
    """bridges2's GPU-shared shape asks 5 CPUs per GPU; the local cluster's nodes have 4 (sinfo knows): SLURM would
    keep it pending for ever (PartitionConfig), so submit says so in one line and leaves no folder behind."""
    result = subprocess.run([GPTPAR, "submit", "dp", "--gpus", "2", *TINY, f"log.runs_dir={tmp_path / 'runs'}",
                             "launch.profile=bridges2", "launch.account=abc123",
                             *([launcher] if launcher == SUBMITIT else [])],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (2, "") and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr == ("gptpar: error: the job asks for 10 CPUs per node (2 task(s) x launch.cpus_per_task=5) "
                             "but partition GPU-shared's nodes have at most 4 (sinfo): it would never start; lower "
                             "launch.cpus_per_task, or use another launch.partition (or launch.profile)\n")
    assert not (tmp_path / "runs").exists()


def test_status_lists_a_pending_plain_sbatch_job_with_slurms_reason(tmp_path: Path) -> None:
    """A job of jobs/dp.sbatch has no run folder until it starts; `gptpar status` lists it pending all the same (SLURM
    knows it by the script's job name) under the folder it will write, with SLURM's reason and its fix."""
    (tmp_path / "runs" / "other").mkdir(parents=True)
    job_id = _run(["sbatch", "--parsable", "--hold", "--cpus-per-task=1", str(REPO / "jobs" / "dp.sbatch")],
                  tmp_path).strip()
    try:
        out = _run([GPTPAR, "status"], tmp_path)
        pending = _run([GPTPAR, "status", "--state", "pending"], tmp_path)
        elsewhere = _run([GPTPAR, "status", "runs/other"], tmp_path)
    finally:
        subprocess.run(["scancel", job_id], check=True, env=clean_env())
    row, detail, count = out.splitlines()[1:]
    assert row.split() == ["pending", f"dp-{job_id}", job_id, "-", "0", "-", "-", "-", "-", "0"]
    assert detail == f"    will never start: JobHeldUser; it is held; release it with: scontrol release {job_id}"
    assert count == "1 run(s): 1 pending" and pending == out
    assert elsewhere.rstrip().endswith("0 run(s): none")  # its folder will not be under that one
    assert not list((tmp_path / "runs").glob("dp-*"))


def test_what_sbatch_refuses_of_a_submitit_job_is_one_line(work: Path) -> None:
    result = subprocess.run([GPTPAR, "submit", "dp", "--gpus", "1", *TINY, f"log.runs_dir={work / 'runs'}",
                             "log.run_id=submitit_refused", "launch.profile=generic", "launch.partition=nope",
                             SUBMITIT], cwd=work, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("gptpar: error: sbatch refused the submitit job: sbatch: error: invalid "
                                    "partition specified: nope; ")
    assert "fix the launch.* key it names" in result.stderr


def test_make_submit_dp_two_gpus(work: Path) -> None:
    run = work / "runs" / "dp2"
    assert _wait(run) == "completed"
    assert _ranks(run) == [0, 1]
    assert all(_final(run, r)["status"] == "completed" for r in (0, 1))
    assert (run / "job" / "submit.sbatch").is_file() and list((run / "job").glob("slurm-*.out"))


def test_sbatch_pp_script(work: Path) -> None:
    """jobs/pp.sbatch as a user sbatch-es it: its run and its output land where `gptpar logs` looks."""
    job_id = (work / "pp_job").read_text()
    run = work / "runs" / f"pp-{job_id}"
    deadline = time.monotonic() + 300
    while not (run / "rank0.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(1)
    assert _wait(run) == "completed"
    header = read_records(run / "rank0.jsonl")[0]
    assert header["config"]["parallel"]["pp_mode"] == "pipeline_parallel" and header["world_size"] == 1
    assert (run / "job" / f"slurm-{job_id}.out").read_text().startswith(f"gptpar pp: job {job_id} restart 0")
    logs = subprocess.run([GPTPAR, "logs", str(run)], capture_output=True, text=True, cwd=work, timeout=60)
    assert f"slurm-{job_id}.out" in logs.stdout and logs.stdout.rstrip().endswith("state: completed")


def test_pipeline_engine_runs_its_stages_on_two_nodes_with_a_replica_each(work: Path) -> None:
    """parallel.pp=2 on 2 nodes x 2 GPUs: stage 0's two replicas on node1, stage 1's on node2 (pp is the
    grid's slowest dimension), so every activation crosses nodes and each dp group stays on one."""
    run = work / "runs" / "pp_engine_2nodes"
    assert _wait(run) == "completed"
    assert _ranks(run) == [0, 1, 2, 3]
    records = {r: read_records(run / f"rank{r}.jsonl") for r in range(4)}
    headers = {r: recs[0] for r, recs in records.items()}
    assert {r: (h["coords"]["pp"], h["coords"]["dp"], h["slurm"]["node"]) for r, h in headers.items()} == {
        0: (0, 0, "node1"), 1: (0, 1, "node1"), 2: (1, 0, "node2"), 3: (1, 1, "node2")}
    for rank, recs in records.items():
        steps = [r for r in recs if r["kind"] == "step"]
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert all((s["loss"] is None) == (rank < 2) and isinstance(s["global_loss"], float) for s in steps)
        assert all(len(s["pp_timeline"]) == 2 * 2 and 0 <= s["bubble"] < 1 for s in steps)  # 2 F + 2 B
    last = {s["global_loss"] for recs in records.values() for s in recs if s["kind"] == "step" and s["step"] == 3}
    assert len(last) == 1  # one loss for the job: every stage and replica reports the same mean


def test_tensor_parallel_groups_stay_on_one_node_and_replicas_span_two(work: Path) -> None:
    """parallel.tp=2 on 2 nodes x 2 GPUs: dp=2 replicas of a TP=2 group, each group's ranks on one node (tp is the
    grid's fastest dimension), gradients averaged across the nodes (the two-node data parallelism of gptpar's
    sbatch script: one job spanning both nodes); one loss for the job."""
    run = work / "runs" / "tp_2nodes"
    assert _wait(run) == "completed"
    assert _ranks(run) == [0, 1, 2, 3]
    records = {r: read_records(run / f"rank{r}.jsonl") for r in _ranks(run)}
    headers = {r: recs[0] for r, recs in records.items()}
    assert {h["slurm"]["job_nodelist"] for h in headers.values()} == {"node[1-2]"}
    assert {r: (h["coords"]["dp"], h["coords"]["tp"], h["slurm"]["node"]) for r, h in headers.items()} == {
        0: (0, 0, "node1"), 1: (0, 1, "node1"), 2: (1, 0, "node2"), 3: (1, 1, "node2")}
    steps = {(s["step"], s["global_loss"]) for recs in records.values() for s in recs if s["kind"] == "step"}
    assert sorted(step for step, _ in steps) == [1, 2, 3]  # every rank logged the same loss at each step


def test_small_sweep_and_rerun_skips_done_points(work: Path) -> None:
    sweep = work / "runs" / "ci_small"
    points = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name != "_jobs")
    assert len(points) == 4
    assert [_wait(p) for p in points] == ["completed"] * 4
    assert len({read_job_record(p)["job_id"].split("_")[0] for p in points}) == 1  # one job array
    out = _run([GPTPAR, "sweep", str(REPO / "sweeps" / "ci_small.yaml"), "--runs-dir", str(work / "runs")], work)
    assert "4 skipped" in out and "0 to run" in out


def test_figures_from_the_runs(work: Path) -> None:
    for run in ("dp2", f"pp-{(work / 'pp_job').read_text()}", "tp_2nodes"):
        _wait(work / "runs" / run)
    out = work / "figures"
    _run([GPTPAR, "report", str(work / "runs"), "--out", str(out), "--group-by", "sweep"], work)  # ad-hoc: compared
    rows = {row["run"]: row for row in csv.DictReader((out / "summary.csv").open())}
    pp_run = f"pp-{(work / 'pp_job').read_text()}"
    shapes = {run: (rows[run]["status"], rows[run]["gpus"], rows[run]["pp_mode"])
              for run in ("dp2", pp_run, "tp_2nodes")}
    assert shapes == {"dp2": ("completed", "2", "single"), pp_run: ("completed", "1", "pipeline_parallel"),
                      "tp_2nodes": ("completed", "4", "single")}
    assert all(float(rows[run]["tokens_per_s_mean"]) > 0 for run in shapes)
    # 2 and 4 GPUs make the scaling figures, the sbatch pipeline job the pipeline-against-model-parallel one (the
    # speedup figure also needs a finished 1-GPU data-parallel run, which is the requeue test's, not waited for here)
    for name in ("throughput_vs_gpus", "time_vs_gpus", "pipeline_vs_model_parallel", "loss_top-level"):
        figure = (out / f"{name}.png").read_bytes()
        assert figure.startswith(b"\x89PNG") and len(figure) > 10_000, name


def test_several_ranks_from_a_one_task_step_as_in_an_interactive_session(work: Path) -> None:
    """Inside `srun --pty bash` (one task), `gptpar train parallel.dp=2` starts its two ranks on the node (the fixture
    started the srun)."""
    srun = INTERACTIVE.pop()
    assert srun.wait(timeout=300) == 0, (work / "interactive.out").read_text()
    run = work / "runs" / "interactive"
    assert _wait(run) == "completed" and _ranks(run) == [0, 1]
    headers = [read_records(run / f"rank{r}.jsonl")[0] for r in (0, 1)]
    assert [h["launcher"] for h in headers] == ["local", "local"]  # spawned here, not SLURM tasks


RESHAPE_STEPS = 60  # one epoch of TINY's corpus; a cancel sent at the first step lands well before the last
# Measured against one uninterrupted rank: rel 1.1e-7 at most for dp=2 -> 1 rank (sbatch, plain), 2.3e-7 for 1 rank
# -> zero2 dp=2 (submitit).
RESHAPE_REL = 1e-6
# launcher: (its first start's words, the --reshape's, each start's (dp, dp_sync) and layout as status shows it);
# plain: jobs/dp.sbatch, sbatch's words, continued by RESHAPE=1 (the ranks' --reshape).
RESHAPES = {"sbatch": (["--gpus", "2"], ["--gpus", "1"],
                       [(2, "bucketed", "dp=2 (bucketed)"), (1, "bucketed", "1 rank")]),
            "submitit": (["--gpus", "1", SUBMITIT], ["--gpus", "2", "parallel.dp_sync=zero2"],
                         [(1, "bucketed", "1 rank"), (2, "zero2", "dp=2 (zero2)")]),
            "plain": (["--ntasks-per-node=2", "--gpus=2"], ["--ntasks-per-node=1", "--gpus=1"],
                      [(2, "bucketed", "dp=2 (bucketed)"), (1, "bucketed", "1 rank")])}


def _start_reshaped(work: Path, common: list[str]) -> dict[str, tuple[Path, str]]:
    """Each RESHAPES job's first start: {launcher: (its run folder, its job id)}."""
    runs, started = work / "runs", {}
    for name in ("sbatch", "submitit"):
        _run([GPTPAR, "submit", "dp", *RESHAPES[name][0], *common, f"log.run_id={name}"], work)
        started[name] = runs / name, read_job_record(runs / name)["job_id"]
    (work / "jobs" / "logs").mkdir(parents=True)  # where the plain script's own output goes, as in a checkout
    env = {**clean_env(), "VENV": str(REPO / ".venv"), "RUNS": str(runs),
           "OVERRIDES": " ".join(w for w in command_words(common) if not w.startswith("log."))}
    job = _run(["sbatch", "--parsable", "--cpus-per-task=1", *RESHAPES["plain"][0], str(REPO / "jobs" / "dp.sbatch")],
               work, env).strip()
    return {**started, "plain": (runs / f"dp-{job}", job)}


def _continue_reshaped(work: Path, name: str, run: Path) -> None:
    """A stopped RESHAPES job submitted again, on its other layout."""
    if name == "plain":
        env = {**clean_env(), "VENV": str(REPO / ".venv"), "RESHAPE": "1"}
        _run(["sbatch", "--parsable", "--cpus-per-task=1", *RESHAPES[name][1], str(REPO / "jobs" / "dp.sbatch"),
              str(run)], work, env)
    else:
        _run([GPTPAR, "submit", "dp", str(run / "config.yaml"), "--reshape", *RESHAPES[name][1]], work)


@pytest.fixture(scope="module")
def reshaped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Its own jobs, submitted when its tests come (not up front: they must still be training when cancelled): one
    uninterrupted rank, and a job of each launcher cancelled at its first step (it stops at a step boundary,
    checkpointed), then submitted again with --reshape on the layout RESHAPES names; every run to its end. The run
    folder of each."""
    work = tmp_path_factory.mktemp("slurm-reshape", numbered=True)
    common = [*TINY, f"log.runs_dir={work / 'runs'}", f"train.max_steps={RESHAPE_STEPS}", "parallel.dp_sync=bucketed"]
    _run([GPTPAR, "submit", "dp", "--gpus", "1", *common, "log.run_id=uninterrupted"], work)
    started = _start_reshaped(work, common)
    deadline, training = time.monotonic() + 300, set(started)
    while training:  # each cancelled as soon as it has stepped: SLURM's TERM, as `gptpar cancel` sends it
        assert time.monotonic() < deadline, f"{training} never logged a step"
        for name in [n for n in training if _stepped(started[n][0])]:
            subprocess.run(["scancel", started[name][1]], check=True, env=clean_env())
            training.remove(name)
        time.sleep(0.1)
    for name, (run, _) in started.items():
        assert _wait(run) == "stopped"
        _continue_reshaped(work, name, run)
    folders = {"uninterrupted": work / "runs" / "uninterrupted", **{name: run for name, (run, _) in started.items()}}
    for run in folders.values():
        assert _wait(run) == "completed"
    return folders


def _stepped(run: Path) -> bool:
    return any(r["kind"] == "step" for r in read_records(run / "rank0.jsonl"))


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["global_loss"] for r in read_records(run / "rank0.jsonl") if r["kind"] == "step"}


@pytest.mark.parametrize("launcher", list(RESHAPES))
def test_a_stopped_job_resumed_with_reshape_logs_the_uninterrupted_losses(reshaped: dict[str, Path],
                                                                          launcher: str) -> None:
    """The job's second start (another layout, the same launcher) continues from the step after the stop with the
    losses of the run left uninterrupted; each start's header records its layout, and status shows the segments."""
    run, layouts = reshaped[launcher], RESHAPES[launcher][2]
    records = read_records(run / "rank0.jsonl")
    headers = [r for r in records if r["kind"] == "header"]
    finals = [r for r in records if r["kind"] == "final"]
    stop = finals[0]["step"]
    assert 0 < stop < RESHAPE_STEPS and [f["status"] for f in finals] == ["stopped", "completed"]
    assert sorted(_losses(run)) == list(range(1, RESHAPE_STEPS + 1))  # each step once
    assert min(r["step"] for r in records if r["kind"] == "step" and r["time"] > headers[1]["time"]) == stop + 1
    expected = _losses(reshaped["uninterrupted"])
    assert [_losses(run)[s] for s in sorted(expected)] == pytest.approx([expected[s] for s in sorted(expected)],
                                                                        rel=RESHAPE_REL)
    assert [(h["sizes"]["dp"], h["config"]["parallel"]["dp_sync"]) for h in headers] == [shown[:2] for shown in layouts]
    assert read_job_record(run).get("backend") == {"sbatch": "slurm", "submitit": "submitit"}.get(launcher)
    status = _run([GPTPAR, "status", str(run.parent)], run.parent)
    assert (f"    segment: steps 1-{stop} on {layouts[0][2]}: " in status
            and f"    segment: steps {stop + 1}-{RESHAPE_STEPS} on {layouts[1][2]}: " in status), status


def test_no_stray_jobs_left(work: Path) -> None:
    if shutil.which("squeue") is None:
        pytest.skip("no squeue")
    mine = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, env=clean_env()).stdout
    assert str(work) not in mine and os.path.isdir(work)


def _release_requeues_until_done(job_id: str, run: Path) -> None:
    """Start each requeue of a job as soon as SLURM may (see _release), until its run has ended. The first requeue
    comes from the real 1-minute limit; its time limit is then raised to RAISED_LIMIT_MIN, as an admin extends a
    job, so that the second round finishes however loaded the machine is (a 1-minute limit goes round once per
    30 s of training, and a round whose start-up outlasts the 30 s makes no progress at all)."""
    deadline, released = time.monotonic() + 600, 0
    while time.monotonic() < deadline and run_state(run) in LIVE_JOB_STATES:
        info = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              env=clean_env()).stdout
        restarts = int(info.split("Restarts=")[1].split()[0]) if "Restarts=" in info else 0
        if "JobState=PENDING" in info and restarts > released:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={RAISED_LIMIT_MIN}"], check=True,
                           env=clean_env())
            _release(job_id)
            released = restarts
        time.sleep(1)


def test_real_time_limit_signal_requeues_until_done(work: Path) -> None:
    """A real 1-minute limit: SLURM sends USR2 launch.signal_s before it, the trainer checkpoints and requeues, and
    the job goes round until training is done (the fixture's thread releases each requeue), every step logged
    exactly once."""
    run = work / "runs" / "limit"
    assert _wait(run, 550) == "completed"
    records = read_records(run / "rank0.jsonl")
    restarts = [r["restart"] for r in records if r["kind"] == "header"]
    finals = [r["status"] for r in records if r["kind"] == "final"]
    assert len(restarts) >= 2 and restarts == list(range(len(restarts)))
    assert finals == ["requeued"] * (len(restarts) - 1) + ["completed"]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, LIMIT_STEPS + 1))


def _sbatch(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return _run(["sbatch", "--parsable", *args], cwd, env).strip()


def _gptpar(cwd: Path, *args: str) -> str:
    return _run([GPTPAR, *args], cwd)


def test_cancel_and_logs_take_every_name_status_shows_a_plain_job_by(tmp_path: Path) -> None:
    """A pending job of jobs/dp.sbatch has no folder: `gptpar cancel` takes it by the RUN status shows (dp-<id>), as
    runs/dp-<id>, or by its job id, and `gptpar logs` says it is pending; no folder is left behind."""
    dp = str(REPO / "jobs" / "dp.sbatch")
    jobs = [_sbatch(tmp_path, "--hold", "--cpus-per-task=1", dp) for _ in range(3)]
    try:
        logs = _gptpar(tmp_path, "logs", f"dp-{jobs[0]}")
        said = [_gptpar(tmp_path, "cancel", name) for name in (f"dp-{jobs[0]}", jobs[1], f"runs/dp-{jobs[2]}")]
    finally:
        subprocess.run(["scancel", *jobs], env=clean_env())
    assert logs.rstrip().endswith(f"state: pending (will never start: JobHeldUser; it is held; release it with: "
                                  f"scontrol release {jobs[0]})")
    assert said == [f"{tmp_path}/runs/dp-{job}: cancelled SLURM job {job} (pending); its run had not started\n"
                    for job in jobs]
    assert not (tmp_path / "runs").exists()


def test_a_plain_job_that_continues_a_run_shows_as_that_run_with_sbatchs_own_fix(tmp_path: Path) -> None:
    """`sbatch jobs/pp.sbatch runs/pp-3` (what `gptpar cancel` prints to resume pp-3) is pp-3 pending, not a new run;
    its 10 CPUs per task never fit the local nodes' 4, and the fix named is sbatch's option, not a launch key."""
    stopped = tmp_path / "runs" / "pp-3"
    stopped.mkdir(parents=True)
    (stopped / "config.yaml").write_text("{}\n")
    job = _sbatch(tmp_path, str(REPO / "jobs" / "pp.sbatch"), "runs/pp-3")
    try:
        deadline = time.monotonic() + 60  # the controller gives its reason at its next scheduling pass
        while "PartitionConfig" not in (out := _gptpar(tmp_path, "status")) and time.monotonic() < deadline:
            time.sleep(1)
        cancelled = _gptpar(tmp_path, "cancel", job)
    finally:
        subprocess.run(["scancel", job], env=clean_env())
    row, detail, count = out.splitlines()[1:]
    assert row.split()[:3] == ["pending", "pp-3", job] and count == "1 run(s): 1 pending"
    assert detail == ("    will never start: PartitionConfig; the job asks for more than the partition's nodes or "
                      "limits allow (CPUs, GPUs, memory, nodes or time); lower sbatch --gpus=TYPE:N, sbatch --nodes=N, "
                      "sbatch --cpus-per-task=N or sbatch --time=HH:MM:SS, or use another partition; it continues "
                      "runs/pp-3")
    assert cancelled.startswith(f"{stopped}: cancelled SLURM job {job} (pending); ")


def test_a_running_plain_job_shows_before_its_trainer_writes_and_its_output_stays_out_of_the_checkout(
        tmp_path: Path) -> None:
    """From squeue's RUNNING to its trainer's first write (30-60 s of imports on a login node) a plain job's folder
    holds no run yet: status lists it `starting`. Its own output goes to jobs/logs/, not the checkout's root. The
    stand-in `gptpar` sleeps until cancelled."""
    (tmp_path / "jobs" / "logs").mkdir(parents=True)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "gptpar").write_text("#!/bin/bash\necho started\nexec sleep 300\n")
    (tmp_path / "venv" / "bin" / "gptpar").chmod(0o755)
    env = {**clean_env(), "VENV": str(tmp_path / "venv")}
    job = _sbatch(tmp_path, "--cpus-per-task=1", "--gpus=1", str(REPO / "jobs" / "dp.sbatch"), env=env)
    out = tmp_path / "runs" / f"dp-{job}" / "job" / f"slurm-{job}.out"
    try:
        deadline = time.monotonic() + 120
        while "started" not in (out.read_text() if out.is_file() else "") and time.monotonic() < deadline:
            time.sleep(1)
        status = _gptpar(tmp_path, "status")
    finally:
        subprocess.run(["scancel", job], env=clean_env())
    row, detail, count = status.splitlines()[1:]
    assert row.split()[:3] == ["starting", f"dp-{job}", job] and count == "1 run(s): 1 starting"
    assert detail == "    its job runs; no log record yet"
    assert (tmp_path / "jobs" / "logs" / f"slurm-{job}.out").is_file() and not list(tmp_path.glob("slurm-*"))


@pytest.mark.parametrize("launcher", ["launch.launcher=sbatch", SUBMITIT])
def test_a_rank_stopped_on_the_second_node_shows_stuck_then_is_named_with_its_line(tmp_path: Path,
                                                                                    launcher: str) -> None:
    """A dp=4 job on two nodes whose rank 2 (the second node's first) the test stops (SIGSTOP; its pid from its live
    state in the run folder): `gptpar status` shows it stuck, `gptpar debug` asks every task through scancel and the
    others answer, and once a rank times out it asks every task of the job for its dump (scancel QUIT, then CONT:
    the stopped rank runs again and dumps), so the final record names rank 2 with its line, as on the local
    launcher."""
    runs = tmp_path / "runs"
    _run([GPTPAR, "submit", "dp", "--gpus", "2", "--nodes", "2", *TINY, *FOREVER, f"log.runs_dir={runs}",
          "launch.partition=GPU", launcher, "parallel.timeout_s=30", "parallel.stuck_after_s=3", "log.run_id=stuck"],
         tmp_path)
    run, folder = runs / "stuck", RunFolder(runs / "stuck")
    try:
        deadline = time.monotonic() + 300
        while not all(any(r["kind"] == "step" for r in read_records(run / f"rank{rank}.jsonl")) for rank in range(4)):
            assert time.monotonic() < deadline and run_state(run) in LIVE_JOB_STATES, "the job never trained"
            time.sleep(0.5)
        live = json.loads(folder.live_path(2).read_text())
        os.kill(live["pid"], signal.SIGSTOP)  # the local cluster's nodes share this machine
        while not (detail := read_run(folder, scheduler="running").detail).startswith("stuck: "):
            assert time.monotonic() < deadline, detail
            time.sleep(0.2)
        debug = _run([GPTPAR, "debug", "stuck", "--runs-dir", str(runs), "--wait", "3"], tmp_path)
        assert _wait(run) == "failed"
    finally:
        subprocess.run(["scancel", read_job_record(run)["job_id"]], env=clean_env())  # a job a failure left running
    rank2 = rf"rank 2 \({live['host']}, pid {live['pid']}\)"
    assert re.fullmatch(rf"stuck: ranks? [\d, ]+ waited \d+ s in .*; {rank2} (never entered|(is in|entered) it).*",
                        detail), detail
    assert re.search(r"; 3 answered within 3 s\n.*\nrank 0 \(\w+, pid \d+\): gptpar/[\w/]+\.py:\d+ \(\w+\), "
                     "waiting in ", debug), debug
    assert "\nrank 2: no answer" in debug, debug
    state = read_run(folder)
    assert re.match(rf"hung: {rank2} .*: it (was stopped in|is in) gptpar/[\w/]+\.py:\d+ \(\w+\); ranks? [\d, ]+ "
                    r"waited \d+ s in it", state.detail), state.detail
    # The ranks that read rank 2's dump read one: where it was stopped, not where it ran on to once continued. A rank
    # srun ended (--kill-on-bad-exit, once the first rank had failed) while it waited for the dumps left no final
    # record, and one whose wait ended first names rank 2 without a line; the others' carry the diagnosis.
    finals = [records[-1] for r in range(4) if (records := [x for x in read_records(run / f"rank{r}.jsonl")
                                                            if x["kind"] == "final"])]
    named = {(s["rank"], s["stopped"], s["where"]) for f in finals if (h := f.get("hang")) for s in h["stuck"]}
    dumped = {entry for entry in named if entry[2] is not None}
    assert len(dumped) == 1 and dumped.pop()[:2] == (2, True) and {entry[0] for entry in named} == {2}, named
