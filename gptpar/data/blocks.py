"""Examples as blocks of seq_len + 1 tokens: the inputs, and the same tokens shifted by one as labels."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from gptpar.errors import GptparError


class BlockDataset(Dataset):
    """Non-overlapping blocks (stride seq_len), so every token is predicted exactly once per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str = "train"):
        self.tokens, self.seq_len = tokens, seq_len
        self.num_blocks = (len(tokens) - 1) // seq_len
        if self.num_blocks < 1:
            raise GptparError(f"the {split} split has {len(tokens)} tokens, fewer than data.seq_len+1="
                              f"{seq_len + 1}; lower data.seq_len or use a larger corpus")

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        block = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return block[:-1], block[1:]
