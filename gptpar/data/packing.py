"""data.packing: several pair examples per row, none attending to another, so short examples stop paying for a
row's worth of padding.

Examples are packed in order, each into the current row while it fits the width (the longest example's, which the
config checked against the context), else into a new one; the tail of a row is padding. A row comes with its
position ids, which restart at 0 with each example (and with the padding): rotary and learned positions see each
example as if it were alone, and the model's forward makes them a block-diagonal causal mask
(gptpar.models.packed_attention). Labels are the examples' own (the prompt masked), so the loss and its token
weighting are those of the unpacked examples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from gptpar.data.pairs import IGNORE, PairDataset

PackedBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, labels, position ids


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Example indices per row: in order, each into the current row while it fits `width`, else a new row."""
    rows: list[list[int]] = []
    used = width
    for index, length in enumerate(lengths):
        if used + length > width:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


class PackedPairs(Dataset):
    """The examples of a `PairDataset` packed into rows of `width` positions; items are (inputs, labels, positions)."""

    def __init__(self, examples: PairDataset, width: int, pad: int):
        self.examples, self.width, self.pad = examples, width, pad
        lengths = [len(prompt) + len(response) - 1 for prompt, response in zip(examples.prompts, examples.responses,
                                                                                strict=True)]
        self.rows = pack_rows(lengths, width)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PackedBatch:
        pieces = [self.examples[i] for i in self.rows[index]]
        tail = self.width - sum(len(x) for x, _ in pieces)
        inputs = torch.cat([*(x for x, _ in pieces), torch.full((tail,), self.pad, dtype=torch.int64)])
        labels = torch.cat([*(y for _, y in pieces), torch.full((tail,), IGNORE, dtype=torch.int64)])
        positions = torch.cat([*(torch.arange(len(x)) for x, _ in pieces), torch.arange(tail)])
        return inputs, labels, positions


def stack_packed(rows: Sequence[PackedBatch]) -> PackedBatch:
    """Rows of one width, stacked into a batch."""
    inputs, labels, positions = zip(*rows, strict=True)
    return torch.stack(inputs), torch.stack(labels), torch.stack(positions)
