"""Launch layer without a cluster: profiles and limits, rendered scripts, quoting, sweeps, states."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gptpar import preemption
from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch import cluster
from gptpar.launch.profiles import profile_names, resolve
from gptpar.launch.runs import run_state
from gptpar.launch.submit import new_point, script_for, shape
from gptpar.launch.sweep import build_points, expand

EXPECTED = Path(__file__).with_name("expected")
REPO = Path(__file__).resolve().parents[1]


def _script(kind: str, overrides: list[str], run_dirs: list[str], out: str = "/scratch/runs/x/job") -> str:
    cfg = shape(load_config(None, overrides), kind)
    spec = resolve(cfg, kind)
    points = [new_point(load_config(None, overrides), Path(d).parent, Path(d).name) for d in run_dirs]
    return script_for(points, spec, "example", Path(out))


CASES = {
    "dp_bridges2.sbatch": ("dp", ["launch.profile=bridges2", "launch.gpus=4", "launch.account=abc123",
                                  "launch.venv=/opt/venv"], ["/scratch/runs/x"]),
    "pp_local.sbatch": ("pp", ["launch.gpus=2", "launch.venv=/opt/venv"], ["/scratch/runs/x"]),
    "dp_perlmutter_2nodes.sbatch": ("dp", ["launch.profile=perlmutter", "launch.gpus=4", "launch.nodes=2",
                                           "launch.account=m1234", "launch.venv=/opt/venv",
                                           "train.batch_size=64"], ["/scratch/runs/x"]),
    "sweep_array.sbatch": ("dp", ["launch.gpus=1", "launch.max_concurrent=2", "launch.venv=/opt/venv"],
                           ["/scratch/runs/s/a=1", "/scratch/runs/s/a=2", "/scratch/runs/s/a=3"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_scripts_match_recorded(name: str) -> None:
    kind, overrides, dirs = CASES[name]
    text = _script(kind, overrides, dirs)
    path = EXPECTED / name
    if os.environ.get("GPTPAR_UPDATE_EXPECTED"):
        path.write_text(text)
    assert text == path.read_text()
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_every_shipped_profile_resolves() -> None:
    assert set(profile_names()) >= {"bridges2", "perlmutter", "local", "generic"}
    for name in profile_names():
        spec = resolve(shape(load_config(None, [f"launch.profile={name}", "launch.gpus=2"]), "dp"), "dp")
        assert spec.tasks_per_node == 2 and spec.gpu_directive


@pytest.mark.parametrize("overrides, message", [
    (["launch.profile=bridges2", "launch.gpus=8"], "limit of 4 GPUs per node on profile bridges2 partition GPU-shared"),
    (["launch.profile=bridges2", "launch.gpus=4", "launch.partition=GPU"], "allocates whole nodes"),
    (["launch.profile=bridges2", "launch.gpus=2", "launch.nodes=2", "train.batch_size=8"], "limit of 1 node"),
    (["launch.profile=bridges2", "launch.gpus=1", "launch.cpus_per_task=6"], "at most 5 CPUs per GPU"),
    (["launch.profile=bridges2", "launch.time=49:00:00"], "walltime limit 48:00:00"),
    (["launch.profile=bridges2", "launch.partition=RM"], "not a partition of profile bridges2"),
    (["launch.profile=nowhere"], "no profile 'nowhere'"),
    (["launch.time=soon"], "launch.time"),
])
def test_limits_are_refused_before_submission(overrides: list[str], message: str) -> None:
    with pytest.raises(GptparError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(shape(load_config(None, overrides), "dp"), "dp")


def test_bridges2_gpu_partition_takes_whole_typed_nodes() -> None:
    cfg = shape(load_config(None, ["launch.profile=bridges2", "launch.partition=GPU", "launch.gpus=8",
                                   "launch.nodes=2", "train.batch_size=64"]), "dp")
    spec = resolve(cfg, "dp")
    assert spec.gpu_directive == "--gpus=v100-32:16" and cfg.parallel.dp == 16


HOSTILE = "$(touch {m}) `touch {m}`; touch {m} && echo 'q\"\n touch {m}"


@pytest.mark.parametrize("field", ["launch.partition", "launch.account", "launch.qos", "launch.constraint",
                                   "launch.gpu_type", "launch.time", "log.run_id", "log.runs_dir"])
def test_hostile_header_values_are_refused(field: str, tmp_path: Path) -> None:
    value = HOSTILE.format(m=tmp_path / "pwned")
    with pytest.raises(GptparError, match=field.split(".")[1]):
        cfg = shape(load_config(None, [f"{field}={value}"]), "dp")
        point = new_point(cfg)
        script_for([point], resolve(cfg, "dp"), "x", point.run_dir / "job")
    assert not (tmp_path / "pwned").exists()


def test_hostile_body_values_run_nothing(tmp_path: Path) -> None:
    """Hostile name, venv and run folder reach the script quoted: executing it runs nothing else."""
    marker = tmp_path / "pwned"
    hostile = HOSTILE.format(m=marker)
    cfg = shape(load_config(None, [f"log.name={hostile}", f"launch.venv={tmp_path / hostile}"]), "dp")
    venv = Path(cfg.launch.venv)
    assert "$(touch" in str(venv)
    (venv / "bin").mkdir(parents=True)
    record = tmp_path / "argv.json"
    fake = venv / "bin" / "gptpar"  # stands in for the trainer: records the argv it was given
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    bindir = tmp_path / "stub-bin"  # srun stand-in: drop srun's options, run the command
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    (bindir / "srun").chmod(0o755)
    run_dir_parent = tmp_path / "runs"
    point = new_point(cfg, run_dir_parent, "r1")
    point.run_dir.mkdir(parents=True)
    text = script_for([point], resolve(cfg, "dp"), cfg.log.name, run_dir_parent / "out")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    env = {**cluster.clean_env(), "PATH": f"{bindir}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", text], env=env, check=True, cwd=tmp_path)
    assert not marker.exists()
    assert json.loads(record.read_text()) == ["train", "config.yaml"]
    assert "#SBATCH --job-name=touch_" in text  # the name is reduced to safe characters


def test_clean_env_drops_surrounding_job_variables() -> None:
    env = {"SLURM_JOB_ID": "7", "SBATCH_PARTITION": "GPU", "SLURM_NTASKS": "4", "RANK": "1",
           "MASTER_PORT": "1", "CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}
    assert cluster.clean_env(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}


def test_sweep_expands_grid_and_zip_deterministically(tmp_path: Path) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: demo\nkind: dp\nbase: {train: {max_steps: 2}}\n"
                     "zip: {launch.gpus: [1, 2], train.batch_size: [8, 16]}\n"
                     "grid: {train.lr: [0.001, 0.002], parallel.dp_sync: [naive]}\n")
    name, kind, points = expand(sweep)
    assert (name, kind) == ("demo", "dp")
    assert [p for p, _ in points] == [
        "launch.gpus=1,train.batch_size=8,train.lr=0.001,parallel.dp_sync=naive",
        "launch.gpus=1,train.batch_size=8,train.lr=0.002,parallel.dp_sync=naive",
        "launch.gpus=2,train.batch_size=16,train.lr=0.001,parallel.dp_sync=naive",
        "launch.gpus=2,train.batch_size=16,train.lr=0.002,parallel.dp_sync=naive"]
    _, _, built = build_points(sweep, runs_dir=str(tmp_path / "runs"))
    assert built[3].cfg.parallel.dp == 2 and built[3].cfg.train.lr == 0.002
    assert built[0].run_dir == (tmp_path / "runs" / "demo" / points[0][0]).resolve()


def test_sweep_errors_name_the_point(tmp_path: Path) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: bad\ngrid: {train.batch_size: [8, 9]}\nbase: {launch: {gpus: 2}}\n")
    with pytest.raises(GptparError, match="point train.batch_size=9"):
        build_points(sweep)


@pytest.mark.parametrize("path", sorted((REPO / "sweeps").glob("*.yaml")))
def test_shipped_sweeps_resolve(path: Path) -> None:
    _, kind, points = build_points(path)
    for point in points:
        resolve(point.cfg, kind)
    if path.stem == "dp_scaling":
        assert [(p.cfg.launch.gpus, p.cfg.train.batch_size) for p in points] == [(1, 64), (2, 128), (4, 256)]


def _log(run: Path, *records: dict) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "rank0.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_run_state_from_logs_without_a_controller(tmp_path: Path) -> None:
    done, dead, timed = tmp_path / "done", tmp_path / "dead", tmp_path / "timed"
    _log(done, {"kind": "header"}, {"kind": "final", "status": "completed"})
    _log(dead, {"kind": "header"}, {"kind": "step", "step": 1})
    _log(timed, {"kind": "header"})
    for run in (dead, timed):  # a local job record whose process is gone: decided, not polled
        (run / "job").mkdir()
        (run / "job" / "job.json").write_text(json.dumps({"cluster": "local", "job_id": "999999999"}))
    (timed / "job" / "slurm-1.err").write_text("*** JOB 1 ON node1 CANCELLED DUE TO TIME LIMIT ***\n")
    assert [run_state(r) for r in (done, dead, timed)] == ["completed", "failed", "timeout"]


def test_scontrol_one_line_parsing() -> None:
    line = ("JobId=12 ArrayJobId=11 ArrayTaskId=1 JobName=x JobState=REQUEUED Reason=BeginTime "
            "Restarts=1 NodeList=node[1-2] Command=/a/b.sbatch")
    info = cluster.parse_scontrol(line)
    assert info["JobState"] == "REQUEUED" and info["NodeList"] == "node[1-2]" and info["Restarts"] == "1"
    assert cluster.SLURM_STATES[info["JobState"]] == "pending"


def test_usr2_sets_the_preemption_flag_only() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    preemption.install_preemption_handler()
    assert not preemption.preemption_requested()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.preemption_requested()
    assert preemption.requeue_current_job() is False  # outside SLURM there is nothing to requeue
    preemption.install_preemption_handler()  # the trainer installs again after the CLI did
    assert preemption.preemption_requested()  # an early signal is not lost
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    preemption.install_preemption_handler()  # a fresh install starts with no request
    assert not preemption.preemption_requested()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
