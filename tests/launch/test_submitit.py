"""launch.launcher=submitit without a cluster: the executor's parameters from the job spec, the choice of backend,
the code snapshot, the Python API's handle, and (slow) a real run on submitit's local executor, equal to the same
run trained as `gptpar train` trains it, and one interrupted there, requeued and resumed to its end. The SLURM side
is in tests/launch/test_slurm.py; the task's requeue decision in tests/launch/test_submitit_task.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gloo_pool import GlooPools
from logsets import dp_run
from rank_training import train_as_gptpar_does

from gptpar import api
from gptpar.cli import main
from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch.backend import backend_named, choose_backend
from gptpar.launch.local import LocalBackend
from gptpar.launch.prepare import prepare_run
from gptpar.launch.profiles import MODULE_GUARD, resolve
from gptpar.launch.submitit_backend import SubmititBackend, executor_parameters
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import read_new_records
from gptpar.snapshot import SNAPSHOT_FILE, take_snapshot
from gptpar.train import preemption

REPO = Path(__file__).resolve().parents[2]
TINY = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "data.source": "synthetic",
        "data.tokenizer": "bytes", "data.seq_len": 16, "data.synthetic_tokens": 20000, "train.batch_size": 4,
        "train.max_steps": 2, "train.eval_every": 0, "train.threads": 1}
DEADLINE_S = 300.0  # a hang guard while waiting on a job or its records: never a timing claim


def _spec(overrides: list[str], kind: str = "dp"):
    cfg = prepare_run(load_config(None, overrides), kind, "/scratch/runs", "x", write=False).cfg
    return cfg, resolve(cfg, kind)


def test_executor_parameters_come_from_the_job_spec_as_the_sbatch_header_does() -> None:
    cfg, spec = _spec(["launch.profile=bridges2", "launch.gpus=4", "launch.account=abc123", "launch.time=01:00:00",
                       "launch.max_concurrent=3", "launch.launcher=submitit"])
    assert executor_parameters("slurm", spec, "ci_small-dp", cfg.launch) == {
        "name": "ci_small-dp", "nodes": 1, "tasks_per_node": 4, "cpus_per_task": 5, "timeout_min": 60,
        "slurm_partition": "GPU-shared", "slurm_account": "abc123", "slurm_signal_delay_s": 120,
        "slurm_array_parallelism": 3,
        "slurm_setup": [MODULE_GUARD, "  module load anaconda3", "  module load cuda", "fi"],
        "slurm_additional_parameters": {"requeue": True, "gpus": "v100-32:4"}}
    cfg, spec = _spec(["launch.gpus=2", "launch.launcher=submitit"])
    assert executor_parameters("local", spec, "x", cfg.launch) == {
        "name": "x", "nodes": 1, "tasks_per_node": 2, "cpus_per_task": 1, "timeout_min": 30, "gpus_per_node": 2}


def test_what_submitit_cannot_take_is_refused_in_one_line() -> None:
    with pytest.raises(GptparError, match=r"^launch.time=00:00:30: launch.launcher=submitit takes whole minutes"):
        _spec(["launch.time=00:00:30", "launch.launcher=submitit"])
    _spec(["launch.time=00:00:30"])  # the sbatch script takes seconds
    cfg, spec = _spec(["launch.profile=generic", "launch.gpus=1", "launch.nodes=2", "launch.launcher=submitit"])
    with pytest.raises(GptparError, match=r"^launch.nodes=2: submitit's local executor runs on this one machine"):
        executor_parameters("local", spec, "x", cfg.launch)


def test_launch_launcher_picks_submitit_where_launch_cluster_says() -> None:
    backend = choose_backend(load_config(None, ["launch.launcher=submitit", "launch.cluster=local"]).launch)
    assert isinstance(backend, SubmititBackend) and (backend.cluster, backend.name) == ("local", "submitit-local")
    assert isinstance(choose_backend(load_config(None, ["launch.cluster=local"]).launch), LocalBackend)
    assert backend_named("submitit").cluster == "slurm" and backend_named("submitit-local").cluster == "local"
    assert backend_named("submitit").scheduler == "SLURM"


def test_dry_run_prints_what_submitit_is_given(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["submit", "dp", "--gpus", "2", "--dry-run", "launch.launcher=submitit", "launch.signal_s=90",
                 f"log.runs_dir={tmp_path}", "log.run_id=x"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# submitit AutoExecutor(folder={tmp_path / 'x' / 'job'}): each task runs, in its run "
                          f"folder, {Path(sys.prefix) / 'bin' / 'gptpar'} train config.yaml from a snapshot")
    assert "\ntasks_per_node=2\n" in out and "\nslurm_signal_delay_s=90\n" in out and "\ntimeout_min=30\n" in out
    assert not (tmp_path / "x").exists()


def test_a_submitit_rank_stops_and_leaves_the_requeue_to_submitit(monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's checkpoint() requeues the job once the rank has exited: the rank itself must not call
    `scontrol requeue` (this test would fail at the process it starts), yet its requeue request is one."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert preemption.can_requeue() and preemption.requeue_current_job() is False
    assert preemption.can_requeue({"SUBMITIT_EXECUTOR": "local"})  # the local executor requeues too
    assert not preemption.can_requeue({})


def test_the_api_handle_reads_its_run_from_the_folder(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "runs" / "r1")
    dp_run(folder.path, [100.0, 300.0], epochs=1, steps_per_epoch=3)
    folder.write_job_record("local", "elsewhere:1", "dp")
    job = api.Job.of(folder.path)
    assert (job.job_id, job.state(), job.wait(timeout=0)) == ("elsewhere:1", "completed", "completed")
    result = job.result()
    assert {k: result[k] for k in ("run_id", "run_dir", "status", "step", "final_loss", "tokens_per_s")} == {
        "run_id": "r1", "run_dir": str(folder.path), "status": "completed", "step": 3, "final_loss": 4.0 - 0.1 * 3,
        "tokens_per_s": 400.0}
    assert result["state"] == "completed"  # the key's earlier name, still read
    report_row = next(row for row in api.report(tmp_path / "runs", frame=False) if row["run"] == "r1")
    assert report_row["status"] == result["status"]  # one word for the run's state in both
    assert result["final"]["status"] == "completed" and result["job_id"] == "elsewhere:1"
    failed = RunFolder(tmp_path / "runs" / "r2")
    dp_run(failed.path, [100.0], epochs=1, status="failed")
    failed.write_job_record("local", "elsewhere:2", "dp")
    with pytest.raises(GptparError, match=r"^run .*r2 failed: rank 0 failed at step 2"):
        api.Job.of(failed.path).result()
    with pytest.raises(GptparError, match="has no job record"):
        api.Job.of(tmp_path)
    with pytest.raises(GptparError, match="one string"):
        api.submit("dp", overrides="train.lr=1")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_a_snapshot_holds_the_package_as_it_is_and_is_what_its_python_imports(tmp_path: Path) -> None:
    code = tmp_path / "code"
    info = take_snapshot(code)
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard", "--", "gptpar").split()
    copied = sorted(p.relative_to(code).as_posix() for p in code.rglob("*") if p.is_file() and p.name != SNAPSHOT_FILE)
    assert copied == sorted(name for name in listed if (REPO / name).is_file())
    assert all((code / name).read_bytes() == (REPO / name).read_bytes() for name in copied)
    assert (info["commit"], info["dirty"]) == (_git("rev-parse", "HEAD").strip(),
                                               bool(_git("status", "--porcelain", "--", "gptpar")))
    seen = subprocess.run([sys.executable, "-c", "import json, gptpar.snapshot as s; print(json.dumps("
                           "s.running_snapshot())); import gptpar.launch.submitit_task as t; print(t.__file__)"],
                          env={**os.environ, "PYTHONPATH": str(code)}, cwd=tmp_path, capture_output=True, text=True,
                          check=True)
    record, task = seen.stdout.splitlines()  # what a job unpickles its task from
    assert json.loads(record) == {"path": str(code), **info} and task == str(code / "gptpar/launch/submitit_task.py")


@pytest.mark.slow
def test_api_submit_on_the_local_executor_trains_as_gptpar_train_does(tmp_path: Path, gloo_pool: GlooPools) -> None:
    runs = tmp_path / "runs"
    job = api.submit("dp", gpus=2, overrides={**TINY, "launch.cluster": "local", "launch.launcher": "submitit",
                                              "log.runs_dir": runs, "log.run_id": "api"})
    # Meanwhile, the same run as `gptpar train parallel.dp=2` trains it, on the session's two gloo ranks.
    gloo_pool.run(2, train_as_gptpar_does, [*(f"{k}={v}" for k, v in TINY.items()), "parallel.dp=2",
                                            f"log.runs_dir={runs}", "log.run_id=train"])
    assert job.wait(timeout=300) == "completed"
    result = job.result()
    steps = [json.loads(line) for line in (runs / "train" / "rank0.jsonl").read_text().splitlines()]
    assert result["final_loss"] == [r for r in steps if r["kind"] == "step"][-1]["global_loss"]
    assert (result["state"], result["step"], result["final"]["status"]) == ("completed", 2, "completed")
    assert job.job_id == f"{socket.gethostname()}:{job.submitit.job_id}"
    assert RunFolder(runs / "api").read_job_record() == {"backend": "submitit-local", "job_id": job.job_id,
                                                          "kind": "dp"}
    headers = [json.loads((runs / "api" / f"rank{r}.jsonl").read_text().splitlines()[0]) for r in (0, 1)]
    assert [h["launcher"] for h in headers] == ["submitit", "submitit"]
    snapshot = headers[0]["code_snapshot"]
    assert Path(snapshot["path"]).parent == runs / "api" / "job"
    assert snapshot["commit"] == _git("rev-parse", "HEAD").strip()
    assert "Starting with JobEnvironment" in job.stdout()


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _segments(log: Path) -> list[list[dict]]:
    """A rank log's records, one list per start (each begins with its header)."""
    segments: list[list[dict]] = []
    for record in read_new_records(log, 0)[0]:
        if record["kind"] == "header":
            segments.append([])
        segments[-1].append(record)
    return segments


def _first_step(log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not any(r["kind"] == "step" for r in read_new_records(log, 0)[0]):
        assert time.monotonic() < deadline, f"no step record in {log} within {DEADLINE_S:g} s"
        time.sleep(0.005)


@pytest.mark.slow
def test_a_local_submitit_job_interrupted_is_requeued_and_resumes_to_its_end(tmp_path: Path) -> None:
    """USR2 to the job's task (what SLURM sends before a time limit; the local controller passes on only TERM): the
    task passes it on, its rank stops at a step boundary with a checkpoint, checkpoint() resubmits the task and the
    local executor starts it again, which resumes the run from its folder: every step logged once, in order."""
    steps = 30
    run = tmp_path / "runs" / "preempted"
    job = api.submit("dp", gpus=1, overrides={**TINY, "train.max_steps": steps, "launch.cluster": "local",
                                              "launch.launcher": "submitit", "log.runs_dir": run.parent,
                                              "log.run_id": run.name})
    _first_step(run / "rank0.jsonl")
    (task,) = _children(int(job.job_id.partition(":")[2]))  # the local controller's one task (job id host:pid)
    (rank,) = _children(task)
    os.kill(rank, signal.SIGSTOP)  # held at its step k >= 1, < steps: the stop cannot race the run's end
    try:
        os.kill(task, signal.SIGUSR2)
    finally:
        os.kill(rank, signal.SIGCONT)
    assert job.wait(timeout=DEADLINE_S, poll_s=0.1) == "completed"
    segments = _segments(run / "rank0.jsonl")
    assert [(s[-1]["kind"], s[-1].get("status")) for s in segments] == [("final", "requeued"), ("final", "completed")]
    first, second = segments
    assert first[-1]["signal"] == "SIGUSR2" and 1 <= first[-1]["step"] < steps
    logged = [r["step"] for segment in (first, second) for r in segment if r["kind"] == "step"]
    assert logged == list(range(1, steps + 1))  # resumed after the last step taken: none repeated, none skipped
    assert second[0]["restart"] == 1
    log = job.stdout()
    assert log.count("Calling checkpoint method.") == 1 and log.count("Requeued job") == 1


def test_the_api_report_says_its_warnings_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A notebook's (or a script's) stdout holds what it prints itself: the report's warnings go to stderr."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "rank0.jsonl").write_text('{"kind": "header", bad\n')  # a truncated last line: a warning
    assert len(api.report(tmp_path, frame=False)) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"warning: {tmp_path / 'a' / 'rank0.jsonl'}:1: skipped a truncated last line")
