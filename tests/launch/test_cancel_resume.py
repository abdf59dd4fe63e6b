"""A cancelled run reads `cancelled`, and every message that says how to resume a run names the command that
resumes that run: `gptpar submit KIND CONFIG` for a run submit or sweep made, `sbatch jobs/KIND.sbatch FOLDER`
for a run of the plain scripts (which take RUN and continue it), `gptpar train CONFIG` for one started here."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from logsets import T0, Rank, config

from gptpar.launch.status import render_status
from gptpar.run.folder import CANCEL_FILE, RunFolder
from gptpar.run.rows import row_of
from gptpar.run.state import read_run

REPO = Path(__file__).resolve().parents[2]


def _submitted(path: Path, kind: str = "dp") -> RunFolder:
    folder = RunFolder(path)
    folder.write_job_record("slurm", "14", kind)
    folder.config_path.write_text("{}\n")  # written at submission
    return folder


def test_a_job_cancelled_before_it_started_is_cancelled_not_failed(tmp_path: Path) -> None:
    cancelled, died = _submitted(tmp_path / "runs" / "c"), _submitted(tmp_path / "runs" / "d")
    cancelled.record_cancel("14")
    resume = f"`gptpar submit dp {cancelled.config_path}` resumes it from its checkpoint"
    assert (read_run(cancelled, scheduler="failed").state, read_run(cancelled).detail) == (
        "cancelled", f"cancelled by gptpar cancel before its first log record; {resume}")
    assert read_run(died, scheduler="failed").detail.startswith("died before its first log record")
    rows = [row_of(read_run(f, scheduler="failed"), ("slurm", "14"), tmp_path, T0) for f in (cancelled, died)]
    assert render_status(rows, 0).endswith("2 run(s): 1 cancelled, 1 failed")


def test_a_cancel_counts_until_the_run_starts_again(tmp_path: Path) -> None:
    folder = _submitted(tmp_path / "c", "pp")
    rank = Rank(folder.path, 0, config(), launcher="slurm").header().step(1).step(2)
    rank.logger.close()
    folder.record_cancel("14")
    assert (read_run(folder).state, read_run(folder).detail.split(";")[0]) == (
        "cancelled", "cancelled by gptpar cancel at step 2")
    record = json.loads((folder.job_dir / CANCEL_FILE).read_text())
    (folder.job_dir / CANCEL_FILE).write_text(json.dumps({**record, "time": T0 - 1}))  # before this start
    assert read_run(folder).state == "failed"


def test_a_stopped_run_names_the_command_that_resumes_it(tmp_path: Path) -> None:
    """Run folders whose path needs quoting: the command is quoted as a shell reads it."""
    runs = tmp_path / "my runs"
    plain, submitted, here = RunFolder(runs / "pp-14"), _submitted(runs / "sub", "pp"), RunFolder(runs / "here")
    for folder, launcher in ((plain, "slurm"), (submitted, "slurm"), (here, "single")):
        Rank(folder.path, 0, config(), launcher=launcher).header().step(1).final("stopped", 1)
    assert [read_run(f).detail.split("; ")[1] for f in (plain, submitted, here)] == [
        f"`sbatch jobs/pp.sbatch {shlex.quote(str(plain.path))}` resumes it from its checkpoint",
        f"`gptpar submit pp {shlex.quote(str(submitted.config_path))}` resumes it from its checkpoint",
        f"`gptpar train {shlex.quote(str(here.config_path))}` resumes it from its checkpoint"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dp", "pp"])
def test_the_plain_scripts_continue_the_run_RUN_names(kind: str, tmp_path: Path) -> None:
    """RUN=runs/<kind>-14 sbatch jobs/<kind>.sbatch trains that folder's config.yaml again (its checkpoint resumes)
    and writes the job's output there; a RUN or OVERRIDES that a shell would run stays a word. Without RUN the job is
    a new run <kind>-<job id>. srun is a stand-in that records its arguments."""
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    srun.chmod(0o755)
    run = tmp_path / "runs" / f"{kind}-14 $(touch owned)"
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "15", "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "n1", "SLURM_SUBMIT_DIR": str(tmp_path), "ARGS_OUT": str(tmp_path / "args"),
           "OVERRIDES": "train.max_steps=9 $(touch owned)"}
    script = str(REPO / "jobs" / f"{kind}.sbatch")
    subprocess.run(["bash", script], env={**env, "RUN": str(run)}, cwd=tmp_path, check=True)
    args = (tmp_path / "args").read_text().splitlines()
    assert args[1:4] == [f"{tmp_path}/.venv/bin/gptpar", "train", f"{run}/config.yaml"]
    assert "train.max_steps=9" in args and "$(touch" in args and not any(a.startswith("log.") for a in args)
    assert (run / "job" / "slurm-15.out").read_text().startswith(f"gptpar {kind}: job 15 ")
    (tmp_path / "args").unlink()
    subprocess.run(["bash", script, str(run)], env=env, cwd=tmp_path, check=True)  # the folder as its argument
    assert (tmp_path / "args").read_text().splitlines() == args
    subprocess.run(["bash", script], env=env, cwd=tmp_path, check=True)
    args = (tmp_path / "args").read_text().splitlines()
    assert {"log.runs_dir=runs", f"log.run_id={kind}-15"} <= set(args)
    assert (tmp_path / "runs" / f"{kind}-15" / "job" / "slurm-15.out").is_file()
    assert not (tmp_path / "owned").exists() and not os.path.exists(run / "owned")


def test_cancel_and_logs_take_a_run_by_the_job_id_status_shows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The JOB column names a run too (here a local launcher's job id, `host:pid.N`); a name that is nothing is one
    line saying where it was looked for."""
    from gptpar.cli import main

    folder = RunFolder(tmp_path / "sweep" / "lr=0.1")
    folder.write_job_record("local", "vm:4242.2", "dp")
    folder.config_path.write_text("{}\n")
    assert main(["cancel", "vm:4242.2", "--runs-dir", str(tmp_path)]) == 0
    assert main(["logs", "vm:4242.2", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{folder.path}: nothing to cancel: no process runs it"
    assert out[-1] == "state: failed (died before its first log record)"
    assert main(["cancel", "vm:4242.3", "--runs-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"gptpar: error: run 'vm:4242.3' not found (as a path, a run or a job id under "
                                       f"{tmp_path})\n")
