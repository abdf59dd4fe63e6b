import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from rank_training import make_config, make_trainer

from gptpar.config import TrainConfig, config_from_dict, load_config
from gptpar.parallel.process_group import RankInfo
from gptpar.run.logfile import validate_record
from gptpar.run.records import RECORDS
from gptpar.train.entry import run_rank as train
from gptpar.train.optim import learning_rate

CPU = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
               launcher="single", backend="gloo", device=torch.device("cpu"))
TINY = ["model.n_layer=2", "data.seq_len=32", "data.tokenizer=bytes", "train.warmup_steps=2",
        "log.progress=none"]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def text_source(shared: Path, data_dir: Path) -> list[str]:
    """The shared corpus through a link in a private data dir, so its token cache stays out of ../shared."""
    if (shared / "tinyshakespeare.txt").is_file():
        (data_dir / "tinyshakespeare.txt").symlink_to(shared / "tinyshakespeare.txt")
        return ["data.source=tinyshakespeare", f"data.dir={data_dir}", "data.max_chars=300000"]
    return ["data.source=stdlib", "data.max_chars=300000"]


@pytest.fixture(scope="module")
def real_text_run(tmp_path_factory):
    from conftest import SHARED_DATA

    runs, data_dir = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("data")
    cfg = load_config(None, [*TINY, *text_source(SHARED_DATA, data_dir), "train.batch_size=16", "train.max_steps=40",
                             "train.lr=3e-3", "train.min_lr=3e-4", "train.eval_every=20", f"log.runs_dir={runs}",
                             "log.run_id=real"])
    result = train(cfg)
    return cfg, result, Path(result["run_dir"])


@pytest.mark.slow
def test_loss_clearly_falls_on_real_text(real_text_run):
    _, result, run_dir = real_text_run
    steps = [r for r in read_records(run_dir / "rank0.jsonl") if r["kind"] == "step"]
    first, last = steps[0]["loss"], sum(r["loss"] for r in steps[-5:]) / 5
    assert first == pytest.approx(math.log(256), abs=0.3)  # a random model is uniform over the bytes
    assert last < first - 1.5, (first, last)
    assert result["status"] == "completed" and result["step"] == 40


@pytest.mark.slow
def test_log_follows_the_schema(real_text_run):
    cfg, _, run_dir = real_text_run
    records = read_records(run_dir / "rank0.jsonl")
    for record in records:
        validate_record(record)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "header" and kinds[-1] == "final" and set(kinds) == set(RECORDS)
    header = records[0]
    assert header["rank"] == 0 and header["world_size"] == 1 and header["restart"] == 0
    assert header["coords"] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}
    assert header["sizes"] == {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1}
    assert header["device"] == "cpu" and header["stage_devices"] == ["cpu"]
    assert config_from_dict(header["config"]) == cfg
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert all(r["tokens"] == 16 * 32 and r["tokens_per_s"] > 0 for r in steps)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [20, 40]
    assert records[-1] == {**records[-1], "status": "completed", "step": 40}
    assert config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text())) == cfg


@pytest.mark.slow
def test_epochs_each_get_a_record(tmp_path):
    cfg = load_config(None, [*TINY, "data.source=synthetic", "data.synthetic_tokens=4000", "data.vocab_size=300",
                             "train.batch_size=8", "train.epochs=2", "train.eval_every=0",
                             f"log.runs_dir={tmp_path}", "log.run_id=epochs"])
    train(cfg)
    records = read_records(tmp_path / "epochs" / "rank0.jsonl")
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps_per_epoch = (3600 - 1) // 32 // 8
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert all(e["steps"] == steps_per_epoch and e["training_time_s"] > 0 and e["val_loss"] > 0 for e in epochs)
    assert [r["epoch"] for r in records if r["kind"] == "step"] == [0] * steps_per_epoch + [1] * steps_per_epoch


@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch(tmp_path):
    common = [*TINY, "data.source=synthetic", "data.vocab_size=300", "train.batch_size=8", "train.max_steps=3",
              "train.eval_every=0", f"log.runs_dir={tmp_path}"]
    train(load_config(None, [*common, "log.run_id=full"]))
    train(load_config(None, [*common, "train.grad_accum=4", "log.run_id=accum"]))
    full = [r["loss"] for r in read_records(tmp_path / "full/rank0.jsonl") if r["kind"] == "step"]
    accum = [r["loss"] for r in read_records(tmp_path / "accum/rank0.jsonl") if r["kind"] == "step"]
    assert accum == pytest.approx(full, rel=1e-4)


def test_accumulated_micro_batches_give_the_whole_batchs_mean_loss_and_gradient(tmp_path):
    """train.grad_accum=4: each micro-batch's mean loss is divided by 4, so the step's loss and gradient are those of
    the whole batch taken at once (one micro-batch, divisor 1). Undivided, both would be 4 times as large."""
    trainer = make_trainer(make_config(["train.grad_accum=4"], tmp_path, "accum"), CPU)
    micro = next(trainer.batches(0, 0))
    assert len(micro) == 4
    accumulated = trainer.forward_backward_step(micro).item()
    grads = {n: p.grad.clone() for n, p in trainer.net.named_parameters()}
    trainer.sync.zero_grad()
    whole = trainer.forward_backward_step([tuple(torch.cat(parts) for parts in zip(*micro, strict=True))]).item()
    assert accumulated == pytest.approx(whole, rel=3e-7)  # measured 8.4e-8 (float32 summation order)
    for name, p in trainer.net.named_parameters():  # measured max |difference| 1.5e-8, gradients up to 0.1
        torch.testing.assert_close(grads[name], p.grad, rtol=0.0, atol=5e-8, msg=name)


def test_learning_rate_warms_up_then_decays_to_min():
    t = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [learning_rate(s, t, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, t, 20) == pytest.approx(1.0)
    assert learning_rate(9, t, 20) == pytest.approx(0.775)  # a third of the cosine (steps 4-19): 0.1 + 0.9 * 0.75
    assert learning_rate(18, t, 20) > 0.1
    assert learning_rate(19, t, 20) == pytest.approx(0.1)  # the last step trains at min_lr


def _gptpar(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gptpar", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_killed_run_resumes_with_the_same_losses(tmp_path):
    """SIGKILL mid-run, start it again: steps continue from the checkpoint with identical losses."""
    common = [*TINY, "data.source=synthetic", "data.vocab_size=300", "train.batch_size=8", "train.max_steps=12",
              "train.eval_every=0", "train.checkpoint_every=3", "train.threads=1", f"log.runs_dir={tmp_path}"]
    straight_run = _gptpar([*common, "log.run_id=straight"])  # trains beside the killed one: two cores
    killed = _gptpar([*common, "log.run_id=killed"])
    log = tmp_path / "killed" / "rank0.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.is_file() and '"step":7,' in log.read_text()):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert _gptpar([*common, "log.run_id=killed"]).wait(120) == 0
    assert straight_run.wait(120) == 0

    straight = {r["step"]: r["loss"] for r in read_records(tmp_path / "straight/rank0.jsonl") if r["kind"] == "step"}
    records = read_records(log)
    headers = [r for r in records if r["kind"] == "header"]
    assert [h["restart"] for h in headers] == [0, 1]
    resumed = {}
    for r in records:  # later segments overwrite re-run steps
        if r["kind"] == "step":
            resumed[r["step"]] = r["loss"]
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == pytest.approx(straight, rel=1e-6)
    second_segment = records[records.index(headers[1]):]
    first_resumed = next(r["step"] for r in second_segment if r["kind"] == "step")
    assert (first_resumed - 1) % 3 == 0 and first_resumed > 1  # right after a checkpoint, not from scratch
