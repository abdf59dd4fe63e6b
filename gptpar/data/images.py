"""Image classification data (data.task=classify): a train and a validation split of (pixel_values, label) items,
pixel_values float32 [3, S, S] at the model's image size S and label an int64 scalar, and the class names.

data.source=synthetic is the embedded offline set: class c is a fixed smooth colour pattern (a seeded 3 x 4 x 4 grid
upsampled to S x S) under per-image Gaussian noise, so its classes are learnable and accuracy rises well above chance
within a few dozen CPU steps, which shows that training works without a download. Each image is generated when it is
read, from a generator seeded by its index, so the set costs no memory at any image size and every rank, and every
run, sees the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gptpar.config import DataConfig
from gptpar.errors import GptparError

SYNTHETIC_SEED = 20_240_601  # the embedded set is one fixed set of images, whatever the run's seed
PATTERN_GRID = 4  # a class pattern's cells a side: low frequencies, which a patch embedding sees at any patch size
NOISE_STD = 1.5  # per pixel, against patterns of standard deviation ~1


@dataclass(frozen=True)
class ImageData:
    train: Dataset
    val: Dataset
    classes: tuple[str, ...]


def load_images(cfg: DataConfig, image_size: int) -> ImageData:
    """The embedded image set (data.source=synthetic) at `image_size` pixels a side; the named sets are
    gptpar.data.image_sets' (gptpar.data.training chooses)."""
    if cfg.source != "synthetic":
        raise GptparError(f"data.source={cfg.source!r} is no embedded image set; use data.source=synthetic")
    return synthetic_images(cfg.synthetic_images, cfg.synthetic_classes, cfg.val_fraction, image_size)


class SyntheticImages(Dataset):
    """Images `first` to `first + count - 1` of the embedded set: image i is of class i mod C, its noise drawn from
    a generator seeded by i."""

    def __init__(self, patterns: torch.Tensor, first: int, count: int):
        self.patterns, self.first, self.count = patterns, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        index = self.first + i
        label = index % self.patterns.size(0)
        generator = torch.Generator().manual_seed(SYNTHETIC_SEED + 1 + index)
        noise = torch.randn(self.patterns.shape[1:], generator=generator)
        return self.patterns[label] + NOISE_STD * noise, torch.tensor(label, dtype=torch.int64)


def class_patterns(classes: int, image_size: int) -> torch.Tensor:
    """Each class's pattern, [classes, 3, S, S]: a seeded grid of colours, bilinearly smoothed to the image size."""
    grid = torch.randn(classes, 3, PATTERN_GRID, PATTERN_GRID, generator=torch.Generator().manual_seed(SYNTHETIC_SEED))
    return F.interpolate(grid, size=(image_size, image_size), mode="bilinear", align_corners=False)


def synthetic_images(images: int, classes: int, val_fraction: float, image_size: int) -> ImageData:
    """The embedded set of `images` images (data.synthetic_images), the last val_fraction of them for validation."""
    val = round(images * val_fraction)
    patterns = class_patterns(classes, image_size)
    return ImageData(SyntheticImages(patterns, 0, images - val), SyntheticImages(patterns, images - val, val),
                     tuple(f"class {c}" for c in range(classes)))
