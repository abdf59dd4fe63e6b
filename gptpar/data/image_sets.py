"""Named image-classification sets as training data (their files: gptpar.data.image_store): each item decoded and
processed by ViT's image processor when it is read, so a set of 100,000 photos is never held decoded, and a bad image
is one line naming its split and index."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset

from gptpar.config import DataConfig
from gptpar.data.image_store import columns, saved_splits, split_names
from gptpar.errors import GptparError, require_extra


@dataclass(frozen=True)
class NamedImages:
    train: Dataset
    val: Dataset
    classes: tuple[str, ...]


def load_named_images(cfg: DataConfig, image_size: int) -> NamedImages:
    """The set's train and validation splits as (pixel_values float32 [3, S, S], label int64) items, processed by
    ViT's image processor at image_size x image_size; fetched first where it is not saved and the hub is reachable."""
    splits = saved_splits(cfg)
    train, val = split_names(cfg, splits)
    image, label = columns(cfg, splits[train].features)
    # transformers 5's PIL backend (4's only one): the same pixels whether or not torchvision is installed
    processor = getattr(transformers, "ViTImageProcessorPil", transformers.ViTImageProcessor)(
        size={"height": image_size, "width": image_size})

    def items(split: str) -> ProcessedImages:
        return ProcessedImages(cfg.source, split, splits[split], image, label, processor)

    return NamedImages(items(train), items(val), tuple(splits[train].features[label].names))


class ProcessedImages(Dataset):
    """One split's items, each decoded from its stored bytes and processed when read."""

    def __init__(self, source: str, split: str, rows: Any, image: str, label: str, processor: Any) -> None:
        datasets = require_extra("datasets", f"data.source={source}", "hf")
        # undecoded: the bytes come to _decode, which names the split and index of one that is not an image
        self.rows = rows.select_columns([image, label]).cast_column(image, datasets.Image(decode=False))
        self.source, self.split, self.image, self.label, self.processor = source, split, image, label, processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[index]
        pixels = self.processor(images=self._decode(row[self.image], index), return_tensors="pt")["pixel_values"][0]
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
