"""The training step's fast path: each option trains as the plain path does (fp32: rel 1e-5), and the log header
records what it resolved to. One process, the trainer's own step (`Trainer.train_step`), tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_training import make_config, make_trainer, named_params, train_steps

from gptpar.parallel.process_group import RankInfo
from gptpar.train.optim import kind_of

SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=torch.device("cpu"))
STEPS = 3


def trained(tmp_path: Path, name: str, overrides: list[str]) -> tuple[list[float], dict[str, torch.Tensor], object]:
    """STEPS steps of one process: losses, parameters by GPT-2 name, the trainer."""
    trainer = make_trainer(make_config(overrides, tmp_path, name), SINGLE)
    return train_steps(trainer, STEPS), named_params(trainer), trainer


def assert_same_training(got: tuple, want: tuple) -> None:
    """Losses within fp32 rounding; parameters within a small share of one AdamW step (lr 0.01): attention's key bias
    has a gradient of pure rounding noise (softmax ignores it), which Adam divides by its own size."""
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, param in want[1].items():
        torch.testing.assert_close(got[1][name], param, rtol=1e-5, atol=5e-5, msg=name)


def test_fused_adamw_trains_as_the_plain_optimizer(tmp_path: Path) -> None:
    fused = trained(tmp_path, "fused", ["train.fused_optimizer=true"])
    plain = trained(tmp_path, "plain", ["train.fused_optimizer=false"])
    assert kind_of(fused[2].optimizer) == "fused" and fused[2].fast_path()["optimizer"] == "fused"
    assert kind_of(plain[2].optimizer) == "for-loop"  # torch's own choice on a CPU
    assert_same_training(fused, plain)
