"""User defaults: set a profile and an account once; recorded in the run, never read by a job's ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gptpar.config import ConfigError, config_from_dict, resolve_layers
from gptpar.errors import GptparError
from gptpar.launch.sweep import expand, run_sweep
from gptpar.user_defaults import detected_profile, resolve_config, user_layers

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.source=stdlib", "data.max_chars=4000",
        "data.seq_len=16", "data.tokenizer=bytes", "train.batch_size=4", "train.max_steps=1", "train.eval_every=0",
        "log.progress=none"]


def _gptpar(*args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptpar", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **env}, timeout=120)


def test_precedence_is_detected_cluster_then_user_file_then_environment_then_config_file_then_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = tmp_path / "user.yaml"
    user.write_text("launch: {account: from-file, partition: GPU, qos: q1}\ntrain: {lr: 0.01}\n")
    config = tmp_path / "c.yaml"
    config.write_text("launch: {qos: q2}\n")
    monkeypatch.setenv("GPTPAR_USER_CONFIG", str(user))
    monkeypatch.setenv("SBATCH_ACCOUNT", "from-sbatch")
    monkeypatch.setenv("NERSC_HOST", "perlmutter")
    cfg, origins = resolve_config(config, ["train.lr=0.02"])
    assert (cfg.launch.profile, cfg.launch.account, cfg.launch.partition) == ("perlmutter", "from-sbatch", "GPU")
    assert (cfg.launch.qos, cfg.train.lr) == ("q2", 0.02)
    assert origins["launch.profile"] == "detected cluster (NERSC_HOST=perlmutter)"
    assert origins["launch.account"] == "environment SBATCH_ACCOUNT"
    assert origins["launch.partition"] == f"user file {user}"
    assert (origins["launch.qos"], origins["train.lr"]) == (str(config), "command line")
    assert "train.batch_size" not in origins  # a default
    monkeypatch.setenv("GPTPAR_ACCOUNT", "mine")
    monkeypatch.setenv("GPTPAR_PROFILE", "bridges2")
    cfg, origins = resolve_config(None, [])
    assert (cfg.launch.profile, cfg.launch.account) == ("bridges2", "mine")
    assert origins["launch.profile"] == "environment GPTPAR_PROFILE"
    assert resolve_config(None, [], user=False)[0].launch.account == ""  # a job's ranks: the file alone


def test_known_clusters_are_detected_only_by_reliable_marks() -> None:
    assert detected_profile("br012.ib.bridges2.psc.edu", {}) == ("bridges2", "host br012.ib.bridges2.psc.edu")
    assert detected_profile("login22", {"NERSC_HOST": "perlmutter"}) == ("perlmutter", "NERSC_HOST=perlmutter")
    assert detected_profile("bridges2", {}) is None and detected_profile("vm", {"NERSC_HOST": "cori"}) is None
    assert [origin for origin, _ in user_layers({"XDG_CONFIG_HOME": "/nonexistent"}, "vm")] == []


def test_the_user_file_is_found_under_xdg_config_home_and_bad_content_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "gptpar").mkdir()
    (tmp_path / "gptpar" / "config.yaml").write_text("launch: {profil: bridges2}\n")
    with pytest.raises(ConfigError, match=f"^user file {tmp_path}/gptpar/config.yaml: unknown key 'launch.profil'; "
                       "launch keys: profile"):
        resolve_layers(user_layers({"XDG_CONFIG_HOME": str(tmp_path)}, "vm"))


@pytest.mark.slow
def test_config_show_names_where_each_value_came_from_and_stays_loadable(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text("launch: {profile: bridges2}\n")
    out = _gptpar("config", "show", "train.lr=0.01",
                  env={"GPTPAR_USER_CONFIG": str(user), "GPTPAR_ACCOUNT": "abc123"})
    assert out.returncode == 0, out.stderr
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines()}
    assert lines["profile"].endswith(f"# user file {user}")
    assert lines["account"].endswith("# environment GPTPAR_ACCOUNT")
    assert lines["lr"].endswith("# command line") and lines["batch_size"].endswith("# default")
    shown = config_from_dict(yaml.safe_load(out.stdout))
    assert (shown.launch.profile, shown.launch.account, shown.train.lr) == ("bridges2", "abc123", 0.01)


@pytest.mark.slow
def test_submit_uses_the_users_profile_and_account(tmp_path: Path) -> None:
    env = {"GPTPAR_PROFILE": "bridges2", "GPTPAR_ACCOUNT": "abc123"}
    out = _gptpar("submit", "dp", "--gpus", "4", "--dry-run", f"log.runs_dir={tmp_path}", env=env)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --account=abc123" in out.stdout and "#SBATCH --gpus=v100-32:4" in out.stdout
    assert "module load cuda" in out.stdout
    out = _gptpar("submit", "dp", "--gpus", "4", "--dry-run", f"log.runs_dir={tmp_path}", env={})
    assert out.returncode == 2 and "limit of 2 GPUs per node on profile local" in out.stderr


@pytest.mark.slow
def test_user_defaults_are_recorded_in_the_run_and_never_read_by_a_jobs_rank(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text("launch: {account: abc123}\ntrain: {lr: 0.003}\n")
    runs = tmp_path / "runs"
    out = _gptpar("train", *TINY, f"log.runs_dir={runs}", "log.run_id=r", env={"GPTPAR_USER_CONFIG": str(user)})
    assert out.returncode == 0, out.stderr
    recorded = yaml.safe_load((runs / "r" / "config.yaml").read_text())
    assert (recorded["launch"]["account"], recorded["train"]["lr"]) == ("abc123", 0.003)
    # A rank started by a launcher takes its config file alone: a user file it cannot parse changes nothing.
    user.write_text("train: {lr: fast}\n")
    rank = {"GPTPAR_USER_CONFIG": str(user), "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"}
    out = _gptpar("train", *TINY, f"log.runs_dir={runs}", "log.run_id=r2", env=rank)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load((runs / "r2" / "config.yaml").read_text())["train"]["lr"] != 0.003
    out = _gptpar("config", "show", env={"GPTPAR_USER_CONFIG": str(user)})
    assert out.returncode == 2 and out.stderr.strip() == (f"gptpar: error: user file {user}: train.lr: "
                                                          "expected a number, got 'fast'")


def test_repeats_go_round_the_whole_sweep_and_are_numbered(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nrepeats: 2\nzip: {launch.gpus: [1, 2], train.batch_size: [8, 16]}\n")
    names = [name for name, _ in expand(sweep)[2]]
    assert names == ["launch.gpus=1,train.batch_size=8,launch.repeat=0", "launch.gpus=2,train.batch_size=16,"
                     "launch.repeat=0", "launch.gpus=1,train.batch_size=8,launch.repeat=1",
                     "launch.gpus=2,train.batch_size=16,launch.repeat=1"]
    # One job array per round and shape, submitted round by round (locally they run in this order).
    assert run_sweep(sweep, dry_run=True, runs_dir=str(tmp_path / "runs")) == 0
    arrays = [line.removeprefix("# points: ") for line in capsys.readouterr().out.splitlines()
              if line.startswith("# points: ")]
    assert arrays == names
    sweep.write_text("name: s\nrepeats: 0\nzip: {launch.gpus: [1, 2]}\n")
    with pytest.raises(GptparError, match="repeats must be an integer from 1 to 100, got 0"):
        expand(sweep)
    sweep.write_text("name: s\nrepeats: 2\ngrid: {launch.repeat: [0, 1]}\n")
    with pytest.raises(GptparError, match="launch.repeat is an axis and repeats=2"):
        expand(sweep)
