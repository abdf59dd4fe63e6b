"""Split a dataset into disjoint, equally sized, seeded shards: one per data-parallel rank.

Every rank computes the same permutation from the same seed, so no rank has to send indices to
another. Equal shards matter: a rank with one batch more than the others would wait forever in
an all-reduce that its peers never join.

`partition_dataset` interleaves the shards by global batch: step k of rank r takes the r-th
slice of the k-th global batch of the shuffled order. The ranks of one step therefore see exactly
the samples a single process with the global batch would see at that step, which is what makes
W-rank training equal single-process training. Samples dropped per epoch: `len(dataset) %
batch_size` (the tail of the shuffled order, so a different set each epoch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gptpar.errors import GptparError


def shuffled_indices(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


class Partition(Dataset):
    """A view of `data` through a list of indices."""

    def __init__(self, data: Any, index: Sequence[int]):
        self.data, self.index = data, list(index)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        return self.data[self.index[i]]


class DataPartitioner:
    """Shuffle the indices of `data` with `seed`, then cut consecutive pieces of the given fractions.

    A piece has floor(fraction * len(data)) samples; what the fractions leave over is unused.
    """

    def __init__(self, data: Any, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234):
        if any(f < 0 for f in sizes) or sum(sizes) > 1 + 1e-9:
            raise GptparError(f"partition sizes {list(sizes)} must be non-negative fractions summing to <= 1")
        self.data = data
        order = shuffled_indices(len(data), seed)
        self.partitions: list[list[int]] = []
        start = 0
        for fraction in sizes:
            # round() first: 1/3 * 9 may come out as 2.9999999999999996, which must count as 3.
            count = math.floor(round(fraction * len(data), 6))
            self.partitions.append(order[start:start + count])
            start += count

    def use(self, partition: int) -> Partition:
        return Partition(self.data, self.partitions[partition])


def partition_dataset(rank: int, world_size: int, dataset: Any, batch_size: int,
                      collate_fn: Callable | None = None, *, seed: int = 1234, epoch: int = 0
                      ) -> DataLoader:
    """This rank's shard as a loader of batch_size // world_size (batch_size is the global batch).

    The shard order is fixed (shuffle=False): the epoch's shuffle is in the partition (seed + epoch),
    so a resumed run can skip its first k batches and see exactly what it would have seen.
    """
    if not 0 <= rank < world_size:
        raise GptparError(f"rank {rank} is outside 0..{world_size - 1}")
    if batch_size % world_size:
        raise GptparError(f"train.batch_size={batch_size} does not divide by the {world_size} "
                          f"data-parallel ranks; use a multiple of {world_size}")
    per_rank = batch_size // world_size
    if len(dataset) < batch_size:
        raise GptparError(
            f"the dataset has {len(dataset)} examples, fewer than one global batch of {batch_size}; "
            "lower train.batch_size or use more data")
    order = shuffled_indices(len(dataset), seed + epoch)
    first = rank * per_rank
    index = [i for start in range(0, len(order) - batch_size + 1, batch_size)
             for i in order[start + first:start + first + per_rank]]
    return DataLoader(Partition(dataset, index), batch_size=per_rank, shuffle=False, drop_last=True,
                      collate_fn=collate_fn)
