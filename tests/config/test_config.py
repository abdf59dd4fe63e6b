import subprocess
import sys

import pytest
import yaml

from gptpar.config import ConfigError, config_from_dict, load_config, reference_markdown, to_yaml


def test_defaults_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.001\n  batch_size: 32\nmodel:\n  preset: gpt2-mini\n")
    cfg = load_config(path, ["train.lr=3e-4", "parallel.dp=4", "data.streaming=true"])
    assert cfg.train.lr == 3e-4  # the override beats the file
    assert cfg.train.batch_size == 32 and cfg.model.preset == "gpt2-mini"
    assert cfg.parallel.dp == 4 and cfg.data.streaming is True
    assert cfg.train.epochs == 1  # untouched default


def test_yaml_times_stay_text_and_numbers_stay_numbers(tmp_path):
    from gptpar.config import read_yaml

    path = tmp_path / "c.yaml"
    path.write_text("launch:\n  time: 01:00:00\n  gpus: 2\ntrain:\n  lr: 0.5\n")
    assert read_yaml(path) == {"launch": {"time": "01:00:00", "gpus": 2}, "train": {"lr": 0.5}}
    assert load_config(path, ["launch.time=02:00:00"]).launch.time == "02:00:00"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.lr=0.01", "log.name=x"])
    assert config_from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


@pytest.mark.parametrize("override, message", [
    ("train.lrr=1", "unknown key 'train.lrr'"),
    ("trainer.lr=1", "unknown section 'trainer'"),
    ("train.lr=fast", "train.lr: expected a number, got 'fast'"),
    ("train.epochs=1.5", "train.epochs: expected an integer"),
    ("data.streaming=maybe", "data.streaming: expected true or false"),
    ("parallel.dp=0", "parallel.dp: 0 is below the minimum 1"),
    ("data.val_fraction=0.9", "data.val_fraction: 0.9 is above the maximum 0.5"),
    ("report.straggler_ratio=0.5", "report.straggler_ratio: 0.5 is below the minimum 1.0"),
    ("parallel.dp_sync=allgather", "parallel.dp_sync: 'allgather' is not allowed; choose one of: naive"),
    ("lr=1", "is not of the form section.key=value"),
    ("parallel.stuck_after_s=120", "parallel.stuck_after_s=120 is not below parallel.timeout_s=120: the job would "
     "fail before it shows stuck; use less, or 0 (half of parallel.timeout_s)"),
])
def test_bad_override_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_cross_key_checks():
    with pytest.raises(ConfigError, match=r"train.batch_size=10 does not divide by parallel.dp\*train.grad_accum=4\*1"):
        load_config(None, ["train.batch_size=10", "parallel.dp=4"])
    with pytest.raises(ConfigError, match="parallel.chunks=8 exceeds the per-rank micro-batch of 4"):
        load_config(None, ["train.batch_size=4", "parallel.pp_mode=pipeline_parallel", "parallel.chunks=8"])
    pipeline = ["parallel.pp=2", "parallel.chunks=4"]
    with pytest.raises(ConfigError) as error:  # 5 sequences leave one over from 4 micro-batches
        load_config(None, ["train.batch_size=5", *pipeline])
    assert str(error.value) == ("train.batch_size=5 gives 5 sequences per replica and micro-step (batch_size / (dp * "
                                "grad_accum)), which do not divide into parallel.chunks=4 micro-batches; use a "
                                "train.batch_size that is a multiple of 4")
    assert load_config(None, ["train.batch_size=8", *pipeline]).parallel.chunks == 4


def test_pipeline_modes_refuse_data_parallel_ranks():
    with pytest.raises(ConfigError, match="parallel.pp_mode=pipeline_parallel drives its stages from one process"):
        load_config(None, ["parallel.pp_mode=pipeline_parallel", "parallel.dp=2"])


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+:\d+: invalid YAML"):
        load_config(path)
    path.write_text("train:\n  foo: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'train.foo'"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.slow
def test_cli_error_is_one_line_exit_2():
    out = subprocess.run([sys.executable, "-m", "gptpar.cli", "config", "show", "train.lr=fast"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "gptpar: error: train.lr: expected a number, got 'fast'"
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_cli_config_show_prints_resolved_yaml(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gptpar.cli", "config", "show", "parallel.dp=2"],
                         capture_output=True, text=True, check=True)
    assert yaml.safe_load(out.stdout)["parallel"]["dp"] == 2


def test_reference_lists_every_key():
    table = reference_markdown()
    for key in ("model.preset", "data.source", "train.batch_size", "parallel.dp_sync", "launch.profile",
                "log.runs_dir"):
        assert f"`{key}`" in table


def test_config_show_prints_what_a_preset_and_a_profile_resolve_to(capsys):
    from gptpar.cli import main

    assert main(["config", "show", "model.preset=gpt2-mini", "model.n_head=4", "launch.profile=bridges2"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert config_from_dict(yaml.safe_load(out)).model.n_layer == 6  # what it shows still loads
    assert lines["n_kv_head"].split() == ["n_kv_head:", "0", "#", "default"]  # GPT-2 has no key/value heads
    assert lines["n_layer"].split() == ["n_layer:", "6", "#", "preset", "gpt2-mini"]
    assert lines["arch"].split() == ["arch:", "gpt2", "#", "preset", "gpt2-mini"]
    assert lines["n_head"].split() == ["n_head:", "4", "#", "command", "line"]  # set: its own origin
    assert lines["partition"].split() == ["partition:", "GPU-shared", "#", "profile", "bridges2"]
    assert lines["gpu_type"].split() == ["gpu_type:", "v100-32", "#", "profile", "bridges2"]
    assert lines["account"].split() == ["account:", "''", "#", "default"]  # the profile has none either
