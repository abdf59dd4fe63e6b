"""What a run trains and validates on, whatever the task: language modelling's blocks of seq_len + 1 tokens, the
pair tasks' (translation, sft) pairs (padded per batch, to one width where shapes are fixed, packed several to
a row with data.packing, the loss on target tokens only), or classify's labelled images (gptpar.data.images)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from gptpar.config import PAIR_TASKS, Config, data_config, fixed_width
from gptpar.data.blocks import BlockDataset
from gptpar.data.corpus import load_tokens
from gptpar.data.image_sets import load_named_images
from gptpar.data.images import load_images
from gptpar.data.packing import PackedPairs, stack_packed
from gptpar.data.pairs import PairData, load_pairs

Collate = Callable[[Any], Any] | None  # how examples become a batch (None: the default stacking)


@dataclass(frozen=True)
class TrainingData:
    train: Dataset
    val: Dataset
    collate: Collate
    vocab_size: int  # the model's output rows: the tokenizer's vocabulary, or an image classifier's classes
    tokenizer: str
    pairs: PairData | None = None  # the pairs, their tokenizer and decoding width (the pair tasks only)
    classes: tuple[str, ...] = ()  # data.task=classify: the class names


def load_training_data(cfg: Config) -> TrainingData:
    data_cfg = data_config(cfg)
    if data_cfg.task == "classify":
        size = cfg.model.shape().image_size
        images = (load_images(data_cfg, size) if data_cfg.source == "synthetic" else
                  load_named_images(data_cfg, size, cfg.train.seed))
        return TrainingData(images.train, images.val, None, len(images.classes), "none", classes=images.classes)
    if data_cfg.task in PAIR_TASKS:
        width = fixed_width(cfg)
        data = load_pairs(data_cfg, width)
        if data_cfg.packing:
            return TrainingData(PackedPairs(data.train, width, data.eos), PackedPairs(data.val, width, data.eos),
                                stack_packed, data.vocab_size, data.tokenizer.name, data)
        return TrainingData(data.train, data.val, data.collate, data.vocab_size, data.tokenizer.name, data)
    tokens = load_tokens(data_cfg)
    return TrainingData(BlockDataset(tokens.train, cfg.data.seq_len, "train"),
                        BlockDataset(tokens.val, cfg.data.seq_len, "validation"), None, tokens.vocab_size,
                        tokens.tokenizer)
