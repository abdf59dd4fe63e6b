"""Named image-classification sets as training data (their files: gptpar.data.image_store): each item decoded and
processed by ViT's image processor when it is read, so a set of 100,000 photos is never held decoded, and a bad image
is one line naming its split and index.

With data.augment, a training image is first cropped and flipped at random (torchvision's RandomResizedCrop and
RandomHorizontalFlip, without torchvision), drawn from (seed, epoch, index) alone: an item is the same whichever rank
reads it and in whatever order, so dp ranks equal one process and a resumed run sees what it would have seen.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import torch
import transformers
from torch.utils.data import Dataset

from gptpar.config import DataConfig
from gptpar.data.image_store import columns, saved_splits, split_names
from gptpar.data.images import ImageData
from gptpar.errors import GptparError, require_extra

CROP_SCALE = (0.08, 1.0)  # of the image's area: torchvision's RandomResizedCrop defaults, the ImageNet recipe's
CROP_RATIO = (3 / 4, 4 / 3)  # width / height


def load_named_images(cfg: DataConfig, image_size: int, seed: int = 0) -> ImageData:
    """The set's train and validation splits as (pixel_values float32 [3, S, S], label int64) items, processed by
    ViT's image processor at image_size x image_size; fetched first where it is not saved and the hub is reachable.
    `seed` (train.seed) draws data.augment's crops and flips."""
    splits = saved_splits(cfg)
    train, val = split_names(cfg, splits)
    image, label = columns(cfg, splits[train].features)
    # transformers 5's PIL backend (4's only one): the same pixels whether or not torchvision is installed
    processor = (getattr(transformers, "ViTImageProcessorPil", None) or transformers.ViTImageProcessor)(
        size={"height": image_size, "width": image_size})

    def items(split: str) -> ProcessedImages:
        augment = seed if cfg.augment and split == train else None
        return ProcessedImages(cfg.source, split, splits[split], image, label, processor, augment)

    return ImageData(items(train), items(val), tuple(splits[train].features[label].names))


class ProcessedImages(Dataset):
    """One split's items, each decoded from its stored bytes (augmented where `augment` is a seed) and processed
    when read."""

    def __init__(self, source: str, split: str, rows: Any, image: str, label: str, processor: Any,
                 augment: int | None = None) -> None:
        datasets = require_extra("datasets", f"data.source={source}", "hf")
        # undecoded: the bytes come to _decode, which names the split and index of one that is not an image
        self.rows = rows.select_columns([image, label]).cast_column(image, datasets.Image(decode=False))
        self.source, self.split, self.image, self.label, self.processor = source, split, image, label, processor
        self.augment, self.epoch = augment, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose crops and flips the items draw (as DistributedSampler.set_epoch): each epoch new ones."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[index]
        image = self._decode(row[self.image], index)
        if self.augment is not None:
            image = augmented(image, np.random.default_rng([self.augment, self.epoch, index]))
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"][0]
        return pixels, torch.tensor(row[self.label], dtype=torch.int64)

    def _decode(self, stored: dict | None, index: int) -> Any:
        """The image as RGB (CIFAR's are; Food-101 has grey and CMYK photos among its colour ones). A saved set holds
        every image's bytes (save_to_disk embeds the files)."""
        image_module = require_extra("PIL.Image", f"data.source={self.source}", "vision")
        if not (stored or {}).get("bytes"):
            raise self._unreadable(index, "nothing stored")
        try:
            with image_module.open(io.BytesIO(stored["bytes"])) as image:
                return image.convert("RGB")  # reads the whole file: a truncated one fails here
        except (OSError, SyntaxError, ValueError) as exc:  # PIL's broken PNG is a SyntaxError
            raise self._unreadable(index, type(exc).__name__) from None

    def _unreadable(self, index: int, why: str) -> GptparError:
        return GptparError(f"data.source={self.source}: image {index} of the {self.split} split is not a readable "
                           f"image ({why})")


def augmented(image: Any, rng: np.random.Generator) -> Any:
    """A random crop (the processor then resizes it), flipped left to right half the time."""
    image = image.crop(crop_box(*image.size, rng))
    flip = require_extra("PIL.Image", "data.augment", "vision").Transpose.FLIP_LEFT_RIGHT
    return image.transpose(flip) if rng.random() < 0.5 else image


def crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, right, bottom), drawn as torchvision's RandomResizedCrop.get_params draws it: ten tries at an area
    of CROP_SCALE and a ratio of CROP_RATIO (uniform in its log) that fit, else the largest centred crop of a ratio
    within CROP_RATIO."""
    for _ in range(10):
        area = width * height * rng.uniform(*CROP_SCALE)
        ratio = math.exp(rng.uniform(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])))
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    w = min(width, round(height * CROP_RATIO[1]))
    h = min(height, round(w / CROP_RATIO[0]))
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h
