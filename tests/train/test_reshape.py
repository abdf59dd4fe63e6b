"""A run continued on another layout (--reshape, issue 51) logs the losses of the run left uninterrupted.

Each case trains SEGMENT steps under its first layout through the trainer's own step and checkpoint, then for each
further layout a new trainer in the same run folder loads that checkpoint (resharded: gptpar.train.reshard) and trains
SEGMENT more; every start's losses are the uninterrupted run's, one process training them all without a stop. Dropout
is 0 (BASE): a checkpoint holds no random state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import make_config, make_trainer, saved_ranks, train_steps

from gptpar.parallel.grid import world_size
from gptpar.parallel.process_group import RankInfo
from gptpar.train.checkpoint import load_checkpoint

SEGMENT = 2  # steps each start trains
ONE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
               launcher="single", backend="gloo", device=torch.device("cpu"))
# The tolerance every layout keeps against one process's fp32 losses (tests/parallel/data_parallel/test_zero.py);
# measured here: 4e-8 to 8.4e-8 for one reshape (pipeline ones too), 1.7e-7 for two (zero2 -> fsdp2 -> tp=2); a
# reshape that drops the optimizer's moments moves the loss after it by 1.4e-3.
REL = 1e-5
QWEN_MOE = ["model.preset=qwen2-moe-tiny", "model.n_embd=32", "model.n_head=4", "model.moe_aux_loss_coef=0.1"]


def _segment(info: RankInfo, runs: Path, name: str, overrides: list[str], resumed: bool, tag: str) -> None:
    """One start of run `name` under `overrides`: from its checkpoint when `resumed`, SEGMENT steps, then a
    checkpoint; each rank saves its losses as `<runs>/<name>-<tag>.rank<R>.pt`."""
    trainer = make_trainer(make_config(overrides, runs, name), info)
    if resumed:
        assert load_checkpoint(trainer.folder.path, {"trainer": trainer}, trainer.checkpoint_name)
    losses = train_steps(trainer, SEGMENT)
    trainer.checkpoints.save()
    torch.save({"losses": losses}, runs / f"{name}-{tag}.rank{info.rank}.pt")


def _run(gloo_pool: GlooPools, runs: Path, name: str, overrides: list[str], resumed: bool, tag: str) -> list[float]:
    """A segment on as many ranks as `overrides` asks for (one: in this process); the replicas' mean loss per step."""
    world = world_size(make_config(overrides, runs, name))
    if world == 1:
        _segment(ONE, runs, name, overrides, resumed, tag)
    else:
        gloo_pool.run(world, _segment, runs, name, overrides, resumed, tag)
    saved = saved_ranks(runs, f"{name}-{tag}")
    return [sum(step) / len(saved) for step in zip(*(r["losses"] for r in saved), strict=True)]


# name: (the model, the layouts of its starts in order)
CASES = {
    "bucketed-dp2-to-dp1": ([], [["parallel.dp=2", "parallel.dp_sync=bucketed"], ["parallel.dp=1"]]),
    "zero2-dp2-to-fsdp2-dp2-to-tp2": ([], [["parallel.dp=2", "parallel.dp_sync=zero2", "parallel.bucket_mb=0.01"],
                                           ["parallel.dp=2", "parallel.dp_sync=fsdp2"], ["parallel.tp=2"]]),
    "fsdp-dp2-to-dp1": ([], [["parallel.dp=2", "parallel.dp_sync=fsdp"], ["parallel.dp=1"]]),
    "dp1-to-zero1-dp2": ([], [["parallel.dp=1"], ["parallel.dp=2", "parallel.dp_sync=zero1"]]),
    "pp2-1f1b-to-dp2": ([], [["parallel.pp=2", "parallel.chunks=2", "parallel.pp_schedule=1f1b"], ["parallel.dp=2"]]),
    "dp4-to-pp2-dp2": ([], [["parallel.dp=4"], ["parallel.pp=2", "parallel.dp=2", "parallel.chunks=2"]]),
    "zero2-dp2-to-tp2": ([], [["parallel.dp=2", "parallel.dp_sync=zero2", "parallel.bucket_mb=0.01"],
                              ["parallel.tp=2"]]),
    "tp2-to-dp1": ([], [["parallel.tp=2"], ["parallel.dp=1"]]),
    "mixture-ep2-to-ep1": (QWEN_MOE, [["parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=naive"], ["parallel.dp=1"]]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_a_run_continued_on_another_layout_logs_the_uninterrupted_losses(tmp_path: Path, gloo_pool: GlooPools,
                                                                         name: str) -> None:
    model, layouts = CASES[name]
    uninterrupted = train_steps(make_trainer(make_config(model, tmp_path, "single"), ONE), SEGMENT * len(layouts))
    losses = [loss for i, layout in enumerate(layouts)
              for loss in _run(gloo_pool, tmp_path, name, [*model, *layout], i > 0, f"start{i}")]
    assert losses == pytest.approx(uninterrupted, rel=REL)
