"""The TensorBoard and W&B mirrors of the JSONL log: what real runs write, read back with each tool's own
reader (W&B's offline `.wandb` file through W&B's own protobuf records), across a restart, and how a
missing package or a failing mirror is reported."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, command_words
from rank_training import BASE, make_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from gptpar.run.logfile import read_rank_log
from gptpar.run.sinks import THROUGHPUT_TAG, Sinks, TensorBoardSink, WandbSink
from gptpar.train.entry import run_rank
from gptpar.train.trainer import Trainer

pytestmark = pytest.mark.slow  # every test here starts processes

RUN = ["model.n_layer=2", "data.synthetic_tokens=4000", "train.max_steps=4", "train.eval_every=2",
       "log.progress=none"]
STEP_TAGS = {"train/loss": "loss", "train/global_loss": "global_loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
             "train/tokens_per_s": "tokens_per_s", "train/step_time_s": "step_time_s",
             "train/peak_mem_bytes": "peak_mem_bytes"}
EPOCH_TAGS = {"epoch/training_time_s", "epoch/tokens_per_s", "epoch/steps"}
MEMORY_TAGS = {"memory/params", "memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes"}
BLOCK, CHUNK_HEADER = 32768, 7  # the leveldb log layout of a `.wandb` file, after its 7-byte ":W&B" header


@pytest.fixture(autouse=True)
def _wandb_off_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """wandb-core writes its own debug logs under the user's cache; keep them with the test."""
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def scalars(folder: Path) -> dict[str, list]:
    """TensorBoard's own view of a folder's event files: tag -> ScalarEvents, restarts purged as it does."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data, records, pending, pos = path.read_bytes(), [], b"", CHUNK_HEADER
    assert data.startswith(b":W&B")
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if left < CHUNK_HEADER or kind == 0:  # the padding at a block's end
            pos += left
            continue
        pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_history(records: list[wandb_internal_pb2.Record]) -> dict[int, dict[str, str]]:
    rows = [{"/".join(item.nested_key) or item.key: item.value_json for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return {int(row["_step"]): row for row in rows}


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_tensorboard_holds_the_step_records_by_step(tmp_path):
    cfg = make_config([*RUN, "log.tensorboard=true"], tmp_path, "tb")
    run_dir = Path(run_rank(cfg)["run_dir"])
    log = read_rank_log(run_dir / "rank0.jsonl")
    run, own = scalars(run_dir / "tb"), scalars(run_dir / "tb" / "rank0")
    assert set(run) == {*STEP_TAGS, *MEMORY_TAGS, *EPOCH_TAGS, "eval/val_loss"} and set(own) == {THROUGHPUT_TAG}
    for tag, field in STEP_TAGS.items():
        assert [e.step for e in run[tag]] == [1, 2, 3, 4]
        assert [e.value for e in run[tag]] == pytest.approx([log.steps[s][field] for s in (1, 2, 3, 4)], rel=1e-6)
    assert [e.wall_time for e in run["train/loss"]] == [log.steps[s]["time"] for s in (1, 2, 3, 4)]
    assert [(e.step, e.value) for e in run["eval/val_loss"]] == [  # the evaluations, then the epoch's at its last step
        (s, pytest.approx(log.evals[s]["val_loss"], rel=1e-6)) for s in (2, 4)] + [
        (4, pytest.approx(log.epochs[0]["val_loss"], rel=1e-6))]
    assert [(e.step, e.value) for e in run["memory/params_bytes"]] == [(1, log.memory["params_bytes"])]
    assert [e.value for e in own["throughput/tokens_per_s"]] == pytest.approx(
        [log.steps[s]["tokens_per_s"] for s in (1, 2, 3, 4)], rel=1e-6)


def test_wandb_offline_keeps_the_config_and_the_loss_history_in_the_run_folder(tmp_path):
    cfg = make_config([*RUN, "log.wandb=offline", "log.wandb_project=sinks"], tmp_path, "wb")
    run_dir = Path(run_rank(cfg)["run_dir"])
    log = read_rank_log(run_dir / "rank0.jsonl")
    (folder,) = offline_runs(run_dir)
    records = wandb_records(folder / "run-wb.wandb")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == ("wb", "sinks", "wb")
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert config == log.header["config"]
    history = wandb_history(records)
    assert sorted(history) == [1, 2, 3, 4]
    assert [float(history[s]["train/loss"]) for s in (1, 2, 3, 4)] == [log.steps[s]["loss"] for s in (1, 2, 3, 4)]
    assert [float(history[s]["eval/val_loss"]) for s in (2, 4)] == [log.evals[s]["val_loss"] for s in (2, 4)]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_a_restarted_run_continues_the_same_tensorboard_folders_and_wandb_run(tmp_path, monkeypatch):
    """A crash after step 3 (checkpoint at 2), then a restart: TensorBoard keeps the restart's step 3
    (like the JSONL reader), and both starts write to the one W&B run id."""
    cfg = make_config([*RUN, "train.max_steps=5", "train.checkpoint_every=2", "log.tensorboard=true",
                       "log.wandb=offline"], tmp_path, "again")
    real_stop_status = Trainer._stop_status

    def crash_after_step_3(self: Trainer) -> str | None:
        if self.step == 3:
            raise KeyboardInterrupt("killed after step 3")
        return real_stop_status(self)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_stop_status", crash_after_step_3)
        with pytest.raises(KeyboardInterrupt):
            run_rank(cfg)
    run_dir = Path(run_rank(cfg)["run_dir"])
    log = read_rank_log(run_dir / "rank0.jsonl")
    assert [h["restart"] for h in log.headers] == [0, 1] and log.headers[1]["time"] < log.steps[3]["time"]

    run, own = scalars(run_dir / "tb"), scalars(run_dir / "tb" / "rank0")
    for events in (run["train/loss"], own["throughput/tokens_per_s"]):
        assert [e.step for e in events] == [1, 2, 3, 4, 5]
        assert [e.wall_time for e in events] == [log.steps[s]["time"] for s in (1, 2, 3, 4, 5)]

    first, second = (wandb_records(folder / "run-again.wandb") for folder in offline_runs(run_dir))
    assert [r.run.run_id for r in (*first, *second) if r.WhichOneof("record_type") == "run"] == ["again", "again"]
    assert sorted(wandb_history(first)) == [1, 2, 3] and sorted(wandb_history(second)) == [3, 4, 5]
    assert [r.exit.exit_code for r in (*first, *second) if r.WhichOneof("record_type") == "exit"] == [1, 0]


def test_a_missing_package_is_one_line_naming_the_setting_and_the_extra(tmp_path):
    """The packages' imports fail for real in a fresh process, as on a machine without them."""
    code = ("import sys\nfrom gptpar.cli import main\nsys.modules['tensorboard'] = sys.modules['wandb'] = None\n"
            "for extra in sys.argv[1:]:\n    assert main(['train', *extra.split()]) == 2\n")
    common = " ".join(command_words(BASE, RUN, [f"log.runs_dir={tmp_path}"]))
    done = subprocess.run([sys.executable, "-c", code, f"{common} log.run_id=a log.tensorboard=true",
                           f"{common} log.run_id=b log.wandb=offline"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gptpar: error: log.tensorboard=true needs the tensorboard extra: pip install 'gptpar[tensorboard]' "
        "(or make install)",
        "gptpar: error: log.wandb=offline needs the wandb extra: pip install 'gptpar[wandb]' (or make install)"]
    assert read_rank_log(tmp_path / "a" / "rank0.jsonl").final["status"] == "failed"


def test_a_failing_mirror_warns_once_and_the_run_and_its_log_go_on(tmp_path, capsys):
    """A file where the TensorBoard folder should be: every event writer fails to open."""
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "tb").write_text("not a folder")
    result = run_rank(make_config([*RUN, "log.tensorboard=true"], tmp_path, "blocked"))
    assert result["status"] == "completed"
    log = read_rank_log(tmp_path / "blocked" / "rank0.jsonl")
    assert sorted(log.steps) == [1, 2, 3, 4] and sorted(log.evals) == [2, 4] and log.final["status"] == "completed"
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("gptpar: warning: rank 0: the TensorBoard mirror is off from here on (")
    assert warnings[0].endswith("); the JSONL log is complete")


def test_every_evaluation_reaches_both_mirrors_at_the_step_it_followed(tmp_path):
    """Validation loss, an epoch's BLEU, test BLEU, answer accuracy and a metric no gptpar logs yet are mirrored as
    `eval/*` (an epoch's timing as `epoch/*`), at the step of the last step record before them."""
    sinks = Sinks([TensorBoardSink(tmp_path, 0), WandbSink(tmp_path, "sinks", "offline")], 0)
    step = {"kind": "step", "epoch": 0, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8, "step_time_s": 0.1,
            "tokens_per_s": 80.0, "data_time_s": 0.0, "peak_mem_bytes": 1}
    scores = {"val_loss": 2.5, "bleu": 12.5, "test_bleu": 11.0, "answer_accuracy": 0.25, "chrf": 40.0}
    for record in ({"kind": "header", "run_id": "ev", "config": {"train": {"epochs": 1}}},
                   {**step, "step": 1}, {**step, "step": 2}, {"kind": "eval", "step": 2, "epoch": 0, "val_loss": 2.6},
                   {"kind": "epoch", "epoch": 0, "training_time_s": 0.2, "tokens_per_s": 80.0, "steps": 2, **scores},
                   {"kind": "final", "status": "completed", "step": 2}):
        sinks.write({"time": 1.0e9, **record})
    sinks.close()
    run = scalars(tmp_path / "tb")
    assert {tag: [(e.step, e.value) for e in events] for tag, events in run.items() if tag.startswith("eval/")} == {
        "eval/val_loss": [(2, pytest.approx(2.6)), (2, 2.5)],
        **{f"eval/{k}": [(2, v)] for k, v in scores.items() if k != "val_loss"}}
    assert [(e.step, e.value) for e in run["epoch/training_time_s"]] == [(2, pytest.approx(0.2))]
    (folder,) = offline_runs(tmp_path)
    (row,) = [row for s, row in wandb_history(wandb_records(folder / "run-ev.wandb")).items() if s == 2]
    assert {k: float(row[f"eval/{k}"]) for k in scores} == scores and float(row["epoch/steps"]) == 2
