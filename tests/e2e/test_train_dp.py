"""`gptpar train parallel.dp=2` end to end: spawned ranks, shared run folder, same model as one process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gptpar.config import ModelConfig
from gptpar.models.build import build_model, count_params
from gptpar.parallel.env import free_port
from gptpar.run.logfile import read_rank_log
from gptpar.train.checkpoint import export_checkpoint

pytestmark = pytest.mark.slow  # every test here starts processes

COMMON = ["model.n_layer=2", "data.seq_len=32", "data.source=synthetic", "data.vocab_size=300",
          "train.batch_size=8", "train.max_steps=3", "train.eval_every=0", "train.threads=1", "log.progress=none"]


def _train(runs, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gptpar", "train", *COMMON, f"log.runs_dir={runs}",
                           f"log.run_id={run_id}", *extra], capture_output=True, text=True, timeout=300)


def test_dp2_trains_the_same_model_as_one_process(tmp_path):
    single = _train(tmp_path, "single")
    dp = _train(tmp_path, "dp", "parallel.dp=2", "parallel.dp_sync=bucketed")
    assert single.returncode == 0, single.stderr
    assert dp.returncode == 0, dp.stderr
    for rank in (0, 1):
        records = [json.loads(line) for line in (tmp_path / "dp" / f"rank{rank}.jsonl").read_text().splitlines()]
        header = records[0]
        assert (header["rank"], header["world_size"], header["launcher"]) == (rank, 2, "local")
        assert header["coords"] == {"pp": 0, "dp": rank, "cp": 0, "tp": 0, "ep": 0}
        assert header["sizes"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 1, "ep": 1}
        steps = [r for r in records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == [1, 2, 3] and all(r["tokens"] == 4 * 32 for r in steps)
        assert records[-1]["status"] == "completed"
    n = count_params(build_model(ModelConfig(n_layer=2), 300, seed=0))  # the tied matrix once
    for run, rank in (("single", 0), ("dp", 0), ("dp", 1)):  # AdamW replicas: 4N + 4N + 8N bytes
        memory = read_rank_log(tmp_path / run / f"rank{rank}.jsonl").memory
        assert (memory["step"], memory["params"]) == (1, n)
        assert (memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]) == (4 * n, 4 * n, 8 * n)
    exported = [export_checkpoint(tmp_path / run, tmp_path / f"{run}.pt") for run in ("single", "dp")]
    a, b = (torch.load(path, weights_only=False)["trainer"]["model"] for path in exported)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_batch_that_does_not_divide_is_refused_before_spawning(tmp_path):
    out = _train(tmp_path, "bad", "parallel.dp=3")
    assert out.returncode == 2
    assert out.stderr.strip() == ("gptpar: error: train.batch_size=8 does not divide by "
                                  "parallel.dp*train.grad_accum=3*1; use a multiple of 3")


def test_torchrun_dash_m_gptpar_trains_as_two_ranks(tmp_path):
    """`torchrun -m gptpar train` works: the ranks read torchrun's variables and adopt its world size."""
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--nproc-per-node=2", "--master-port", str(free_port()), "-m", "gptpar",
                          "train", *COMMON, f"log.runs_dir={tmp_path}", "log.run_id=tr"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    headers = [json.loads((tmp_path / "tr" / f"rank{r}.jsonl").read_text().splitlines()[0]) for r in (0, 1)]
    assert [(h["launcher"], h["world_size"], h["coords"]["dp"]) for h in headers] == [("torchrun", 2, 0),
                                                                                      ("torchrun", 2, 1)]
    assert headers[0]["config"]["parallel"]["dp"] == 2  # adopted from the launcher, in the header
    assert yaml.safe_load((tmp_path / "tr" / "config.yaml").read_text())["parallel"]["dp"] == 1  # as submitted
