"""The data position across a reshape (issue 51) for every task's training set: a run stopped after STOP steps of
an epoch under one data-parallel size and continued under another sees, step by step, the samples of the run left
uninterrupted, so that the epoch sees every sample once and none twice.

Each set is loaded as the trainer loads it (gptpar.data.training) and cut into steps by the trainer's own code
(gptpar.train.trainer.replica_steps: the replica's shard, its skip to the position, the epoch's augmentation). A
sample is known by its collated row: its inputs and labels up to its last target token, so that padding (per batch,
which differs with the replicas' share of a batch) does not hide it; an image by its pixels and label.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptpar.config import Config, load_config, updated
from gptpar.data.pairs import IGNORE
from gptpar.data.training import TrainingData, load_training_data
from gptpar.train.trainer import replica_steps, shard_loader

BATCH = 8
EPOCH = 1  # an epoch after the first: its own shuffle
STOP = 2  # steps trained before the stop
SFT = ["data.task=sft", "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=40",
       "data.max_target_len=40"]
TASKS = {
    "translation": ["data.task=translation", "data.tokenizer=bytes", "data.max_source_len=24",
                    "data.max_target_len=24"],
    "sft": SFT,
    "sft-packed": [*SFT, "data.packing=true"],
    "classify": ["data.task=classify", "model.preset=vit-tiny", "data.source=synthetic", "data.synthetic_images=64"],
}
# (dp, grad_accum) before the stop -> after it
RESHAPES = [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 2))]


def _pairs_file(folder: Path) -> str:
    """Forty German-English pairs, each its own (numbered) sentence."""
    rows = [{"de": f"satz nummer {i} hier", "en": f"sentence number {i} here"} for i in range(40)]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"data.source=jsonl:{path}"


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Config, TrainingData]]:
    folder = tmp_path_factory.mktemp("pairs")
    loaded = {}
    for task, words in TASKS.items():
        extra = [_pairs_file(folder)] if task == "translation" else []
        cfg = load_config(None, [*words, *extra, f"train.batch_size={BATCH}", "train.seed=5"])
        loaded[task] = cfg, load_training_data(cfg)
    return loaded


def _keys(batch: tuple[torch.Tensor, ...]) -> list[bytes]:
    """Each row's sample, whatever padding its batch gave it."""
    inputs, labels = batch[0], batch[1]
    if labels.dim() == 1:  # an image and its class
        return [inputs[i].numpy().tobytes() + labels[i].numpy().tobytes() for i in range(len(inputs))]
    keys = []
    for row, target in zip(inputs, labels, strict=True):
        end = int((target != IGNORE).nonzero().max()) + 1
        keys.append(row[:end].numpy().tobytes() + target[:end].numpy().tobytes())
    return keys


def _steps(cfg: Config, data: TrainingData, dp: int, accum: int, skip: int) -> list[list[bytes]]:
    """Each step's samples over every replica of `dp`, from step `skip` of the epoch on, as the trainer cuts them."""
    train = updated(cfg, {"train.grad_accum": accum}).train
    per_epoch = len(shard_loader(data.train, data.collate, 0, 1, cfg.train, EPOCH)) // cfg.train.grad_accum
    replicas = [replica_steps(data.train, data.collate, r, dp, train, EPOCH, skip, per_epoch) for r in range(dp)]
    return [sorted(key for step in steps for batch in step for key in _keys(batch))
            for steps in zip(*replicas, strict=True)]


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize(("before", "after"), RESHAPES, ids=lambda layout: "dp{}x{}".format(*layout))
def test_an_epoch_continued_on_another_layout_sees_every_sample_once(sets, task: str, before: tuple[int, int],
                                                                     after: tuple[int, int]) -> None:
    cfg, data = sets[task]
    uninterrupted = _steps(cfg, data, 1, 1, 0)
    resumed = _steps(cfg, data, *before, 0)[:STOP] + _steps(cfg, data, *after, STOP)
    assert resumed == uninterrupted and len(resumed) > STOP
    seen = [key for step in resumed for key in step]
    assert len(seen) == len(set(seen)) == len(resumed) * BATCH  # none twice
    assert 0 <= len(data.train) - len(seen) < BATCH  # every sample but the tail short of a batch
