"""Data: sources, tokenizers, cached token arrays, blocks of seq_len + 1 tokens, and DP partitions."""

from gptpar.data.blocks import BlockDataset
from gptpar.data.corpus import TokenSplits, load_tokens
from gptpar.data.partition import DataPartitioner, Partition, partition_dataset

__all__ = ["BlockDataset", "DataPartitioner", "Partition", "TokenSplits", "load_tokens", "partition_dataset"]
