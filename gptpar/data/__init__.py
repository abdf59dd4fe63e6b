"""Data: sources, tokenizers, cached token arrays, blocks of seq_len + 1 tokens, translation pairs (translation.py)
and DP partitions.

The submit side uses the tokenizer module without torch, so the torch-backed names below (the
assignment's `DataPartitioner`, `Partition`, `partition_dataset` among them) are imported when first used.
"""

from importlib import import_module
from typing import Any

_HOMES = {"BlockDataset": "blocks", "TokenSplits": "corpus", "load_tokens": "corpus", "DataPartitioner": "partition",
          "Partition": "partition", "partition_dataset": "partition"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(f"gptpar.data.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'gptpar.data' has no attribute {name!r}")
