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

from gptpar.cli import main
from gptpar.cluster.profiles import profile_names
from gptpar.cluster.shape import shaped
from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch import slurm
from gptpar.launch.local import local_job_id
from gptpar.launch.prepare import prepare_run
from gptpar.launch.profiles import MODULE_GUARD, guarded_setup, resolve
from gptpar.launch.render import render_script
from gptpar.launch.sweep import build_points, expand
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLogger
from gptpar.run.names import point_label
from gptpar.run.state import read_run
from gptpar.train import preemption

EXPECTED = Path(__file__).parents[1] / "expected"
REPO = Path(__file__).resolve().parents[2]


def _script(kind: str, overrides: list[str], run_dirs: list[str], out: str = "/scratch/runs/x/job") -> str:
    points = [prepare_run(load_config(None, overrides), kind, Path(d).parent, Path(d).name, write=False)
              for d in run_dirs]
    return render_script(points, resolve(points[0].cfg, kind), "example", Path(out))


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
@pytest.mark.slow
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
        spec = resolve(shaped(load_config(None, [f"launch.profile={name}", "launch.gpus=2"]), "dp"), "dp")
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
    (["launch.profile=bridges2", "train.precision=bf16"],
     "train.precision=bf16: the job's v100-32 GPUs (launch.gpu_type) support fp32, fp16 or auto"),
    (["launch.profile=bridges2", "train.precision=tf32"], "train.precision=tf32"),
])
def test_limits_are_refused_before_submission(overrides: list[str], message: str) -> None:
    with pytest.raises(GptparError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(shaped(load_config(None, overrides), "dp"), "dp")


@pytest.mark.parametrize("overrides", [["train.precision=fp16"], ["train.precision=fp32"], ["train.precision=auto"],
                                       ["train.precision=bf16", "launch.gpu_type=a100"],
                                       ["train.precision=bf16", "launch.gpu_type=mystery"]])
def test_a_precision_the_gpu_type_has_or_an_unknown_type_is_accepted(overrides: list[str]) -> None:
    resolve(shaped(load_config(None, ["launch.profile=bridges2", *overrides]), "dp"), "dp")


def test_a_dry_run_on_a_cluster_profile_without_an_account_warns_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch refuses such a job on a cluster that bills an allocation; a dry run never reaches sbatch, so it says so
    (on stderr: stdout is the script). An account from launch.account or sbatch's SBATCH_ACCOUNT silences it."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nkind: dp\ngrid:\n  train.lr: [0.1, 0.2]\n")
    runs = f"log.runs_dir={tmp_path / 'runs'}"
    warning = ("warning: profile bridges2: no account (launch.account, GPTPAR_ACCOUNT or SBATCH_ACCOUNT); a cluster "
               "that bills an allocation refuses the job; set launch.account=...\n")
    for argv in (["submit", "dp", "--gpus", "2", runs], ["sweep", str(sweep), runs]):
        assert main([*argv, "--dry-run", "launch.profile=bridges2"]) == 0
        out, err = capsys.readouterr()
        assert err == warning and "#SBATCH --partition=GPU-shared" in out
        assert main([*argv, "--dry-run", "launch.profile=bridges2", "launch.account=abc123"]) == 0
        assert capsys.readouterr().err == ""
    monkeypatch.setenv("SBATCH_ACCOUNT", "abc123")
    assert main(["submit", "dp", "--gpus", "2", runs, "--dry-run", "launch.profile=bridges2"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["submit", "dp", "--gpus", "2", runs, "--dry-run"]) == 0 and capsys.readouterr().err == ""  # local


def test_bf16_on_v100_is_one_line_at_submission(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "dp", "--gpus", "2", "--dry-run", "launch.profile=bridges2", "train.precision=bf16"]) == 2
    assert capsys.readouterr().err == ("gptpar: error: train.precision=bf16: the job's v100-32 GPUs (launch.gpu_type) "
                                       "support fp32, fp16 or auto\n")


def test_bridges2_gpu_partition_takes_whole_typed_nodes() -> None:
    cfg = shaped(load_config(None, ["launch.profile=bridges2", "launch.partition=GPU", "launch.gpus=8",
                                   "launch.nodes=2", "train.batch_size=64"]), "dp")
    spec = resolve(cfg, "dp")
    assert spec.gpu_directive == "--gpus=v100-32:16" and cfg.parallel.dp == 16


HOSTILE = "$(touch {m}) `touch {m}`; touch {m} && echo 'q\"\n touch {m}"


@pytest.mark.parametrize("field", ["launch.partition", "launch.account", "launch.qos", "launch.constraint",
                                   "launch.gpu_type", "launch.time", "log.run_id", "log.runs_dir"])
def test_hostile_header_values_are_refused(field: str, tmp_path: Path) -> None:
    value = HOSTILE.format(m=tmp_path / "pwned")
    with pytest.raises(GptparError, match=field.split(".")[1]):
        point = prepare_run(load_config(None, [f"{field}={value}"]), "dp", write=False)
        render_script([point], resolve(point.cfg, "dp"), "x", point.folder.job_dir)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_hostile_body_values_run_nothing(tmp_path: Path) -> None:
    """Hostile name, venv and run folder reach the script quoted: executing it runs nothing else."""
    marker = tmp_path / "pwned"
    hostile = HOSTILE.format(m=marker)
    cfg = shaped(load_config(None, [f"log.name={hostile}", f"launch.venv={tmp_path / hostile}"]), "dp")
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
    point = prepare_run(cfg, None, run_dir_parent, "r1", write=False)
    point.folder.path.mkdir(parents=True)
    text = render_script([point], resolve(point.cfg, "dp"), cfg.log.name, run_dir_parent / "out")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    env = {**slurm.clean_env(), "PATH": f"{bindir}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", text], env=env, check=True, cwd=tmp_path)
    assert not marker.exists()
    assert json.loads(record.read_text()) == ["train", "config.yaml"]
    assert "#SBATCH --job-name=touch_" in text  # the name is reduced to safe characters


def test_clean_env_drops_surrounding_job_variables_and_keeps_the_users_sbatch_defaults() -> None:
    env = {"SLURM_JOB_ID": "7", "SBATCH_ACCOUNT": "abc123", "SLURM_NTASKS": "4", "RANK": "1",
           "MASTER_PORT": "1", "CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}
    assert slurm.clean_env(env) == {"SBATCH_ACCOUNT": "abc123", "CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}


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
    assert built[0].folder.path == (tmp_path / "runs" / "demo" / points[0][0]).resolve()


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


def _header(log: RankLogger) -> None:
    log.log("header", schema_version=2, run_id="r", config={}, rank=0, world_size=1, coords={}, sizes={},
            restart=0, host="h", device="cpu", torch_version="2", transformers_version="5", git_commit="x",
            slurm={}, start_time=0.0)


def test_run_state_from_logs_without_a_controller(tmp_path: Path) -> None:
    done, dead, timed, never = (RunFolder(tmp_path / name) for name in ("done", "dead", "timed", "never"))
    for folder in (done, dead, timed):
        log = RankLogger(folder.path, 0)
        _header(log)
        if folder is done:
            log.log("final", status="completed", step=0)
        log.close()
    for folder in (dead, timed, never):  # a local job record whose process is gone: decided, not polled
        folder.write_job_record("local", "otherhost:999999999", "dp")
    (timed.job_dir / "slurm-1.err").write_text("*** JOB 1 ON node1 CANCELLED DUE TO TIME LIMIT ***\n")
    (never.job_dir / "rank0.err").write_text("Traceback ...\nModuleNotFoundError: No module named 'gptpar'\n")
    runs = [read_run(f) for f in (done, dead, timed, never)]
    assert [r.state for r in runs] == ["completed", "failed", "timeout", "failed"]
    assert "rank 0 died without a final record" in runs[1].detail
    assert runs[3].detail == ("died before its first log record (rank0.err: ModuleNotFoundError: No module "
                              "named 'gptpar')")


def test_scontrol_one_line_parsing() -> None:
    line = ("JobId=12 ArrayJobId=11 ArrayTaskId=1 JobName=x JobState=REQUEUED Reason=BeginTime "
            "Restarts=1 NodeList=node[1-2] Command=/a/b.sbatch")
    info = slurm.parse_scontrol(line)
    assert info["JobState"] == "REQUEUED" and info["NodeList"] == "node[1-2]" and info["Restarts"] == "1"
    assert slurm.SLURM_STATES[info["JobState"]] == "pending"


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


def _sbatch_lines(text: str) -> set[str]:
    """The #SBATCH lines that shape a job (name and output file aside)."""
    return {line for line in text.splitlines() if line.startswith("#SBATCH")
            and not line.startswith(("#SBATCH --job-name", "#SBATCH --output"))}


@pytest.mark.parametrize("kind", ["dp", "pp"])
def test_plain_job_scripts_do_not_drift_from_the_template(kind: str) -> None:
    """jobs/dp.sbatch and jobs/pp.sbatch are what `gptpar submit` renders for bridges2 with 2 GPUs:
    same #SBATCH lines, the profile's set-up lines, the same srun options and `gptpar train`, and
    their output in the run folder's job/ where `gptpar logs` looks."""
    plain = (REPO / "jobs" / f"{kind}.sbatch").read_text()
    overrides = ["launch.profile=bridges2", "launch.gpus=2", "launch.time=01:00:00", "launch.venv=/v"]
    rendered = _script(kind, overrides, ["/scratch/runs/x"])
    assert _sbatch_lines(plain) == _sbatch_lines(rendered)
    for line in resolve(prepare_run(load_config(None, overrides), kind, write=False).cfg, kind).setup:
        assert f"\n  {line}\n" in plain
    assert "srun --kill-on-bad-exit=1 \\\n" in plain and '"$VENV/bin/gptpar" train ' in plain
    assert "--kill-on-bad-exit=1 \\\n  /v/bin/gptpar train config.yaml" in rendered
    assert 'exec >>"$RUN_DIR/job/slurm-$SLURM_JOB_ID.out" 2>>"$RUN_DIR/job/slurm-$SLURM_JOB_ID.err"' in plain
    assert f'"log.run_id={kind}-$SLURM_JOB_ID"' in plain and f"RUN_DIR=${{RUNS:-runs}}/{kind}-$SLURM_JOB_ID" in plain


def test_the_profiles_module_lines_run_only_where_environment_modules_exist() -> None:
    """bridges2's `module load` lines are guarded as jobs/*.sbatch guard them: a node without modules starts the job
    without `module: command not found`; other set-up lines run as they are."""
    script = _script("dp", ["launch.profile=bridges2", "launch.gpus=2"], ["/scratch/runs/x"])
    assert f"\n{MODULE_GUARD}\n  module load anaconda3\n  module load cuda\nfi\nset -euo" in script
    assert MODULE_GUARD.startswith("if command -v module >/dev/null; then")
    assert guarded_setup(["echo a", "module load x", "module load y", "echo b", "module load z"]) == [
        "echo a", MODULE_GUARD, "  module load x", "  module load y", "fi", "echo b", MODULE_GUARD, "  module load z",
        "fi"]


def test_a_sweep_point_is_named_by_its_keys_and_each_local_job_has_its_own_id() -> None:
    assert point_label(["parallel.dp_sync=zero1", "train.lr=0.001", "launch.repeat=1"]) == \
        "dp_sync=zero1, lr=0.001, repeat=1"
    assert point_label(["model.dropout=0.1", "train.dropout=0.2"]) == "model.dropout=0.1, train.dropout=0.2"
    assert point_label([]) == "base"
    assert [local_job_id("vm", 123, n) for n in (1, 2)] == ["vm:123.1", "vm:123.2"]


@pytest.mark.parametrize(("reason", "said"), [
    ("None", "queued"), ("Resources", "queued: Resources"), ("QOSMaxGRESPerUser", "queued: QOSMaxGRESPerUser"),
    ("PartitionConfig", "will never start: PartitionConfig; the job asks for more than the partition's nodes or "
                        "limits allow"),
    ("QOSMaxGRESPerJob", "will never start: QOSMaxGRESPerJob; the job asks for more than its QOS or account allows"),
    ("JobHeldUser", "will never start: JobHeldUser; it is held; release it with: scontrol release 14"),
])
def test_a_pending_reason_says_whether_waiting_can_clear_it(reason: str, said: str) -> None:
    """A per-user limit clears as the user's other jobs end; a per-job limit or the partition's shape never does."""
    assert slurm.pending_why(reason, "14").startswith(said)
