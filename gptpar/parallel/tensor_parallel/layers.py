"""gptpar's tensor-parallel layers for GPT-2, Megatron-style, on transformers' `Conv1D` (weight in x out).

Each layer is cut from the whole layer of an unsharded model, so T ranks together hold exactly its parameters:
- `ColumnParallelConv1D`: output columns split; input replicated (`copy_to_tp`) or, with sequence parallelism,
  gathered from sequence shards (`gather_sequence`);
- `RowParallelConv1D`: input rows split; the partial outputs summed (`reduce_from_tp`) or reduce-scattered into
  sequence shards (`reduce_scatter_sequence`); the bias, replicated, added once after the sum;
- `VocabParallelEmbedding` and `VocabParallelHead`: the tied vocabulary matrix split by rows (the token table
  built padded to a multiple of T by gptpar.models.build.build_model, padding rows zero and masked out of the loss);
- `SequenceParallelLayerNorm`: replicated parameters that see only this rank's sequence shard, so their
  gradients are summed over the group (`copy_to_tp` on the parameter itself, which leaves .grad whole before any
  data-parallel hook sees it); `SequenceShardedPositions`: the position rows of this rank's shard, whose
  gradients are all-gathered (`own_rows`), so every rank's table gradient is whole.

Sharded parameters carry a `TPShard` (attribute `tp_shard`) saying how the whole tensor is rebuilt from the
ranks' pieces; `gptpar.parallel.tensor_parallel.state` uses it for checkpoints, gathering and gradient norms.

Dropout: where activations are replicated every rank of the group draws the same mask (they share the seed and
draw in the same order); where they are sharded (attention probabilities of this rank's heads, and with
sequence parallelism the residual stream's sequence shards) `sharded_rng` gives each rank its own stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gptpar.errors import GptparError
from gptpar.parallel.tensor_parallel.comm import (
    copy_to_tp,
    gather_last_dim,
    gather_sequence,
    own_rows,
    reduce_from_tp,
    reduce_scatter_sequence,
)


@dataclass(frozen=True)
class TPShard:
    """A parameter split along `dim` into T equal pieces, rank r's piece holding the r-th slice of each of `parts`
    equal blocks of the whole dim (3 for the fused q, k, v columns, else 1)."""

    dim: int
    parts: int


def shard(tensor: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> nn.Parameter:
    """Rank `rank`'s piece of `tensor` (see TPShard)."""
    blocks = tensor.detach().chunk(parts, dim)
    piece = torch.cat([block.chunk(size, dim)[rank] for block in blocks], dim).clone()
    param = nn.Parameter(piece)
    param.tp_shard = TPShard(dim, parts)
    return param


def check_vocab_split(rows: int, size: int) -> None:
    """The token table must split into equal vocabulary pieces: gptpar.models.build.build_model pads it for that."""
    if rows % size:
        raise GptparError(f"the token table's {rows} rows do not split into parallel.tp={size} equal pieces; build "
                          f"the model with gptpar.models.build.build_model(..., shards={size}), which pads it")


def group_place(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def sharded_rng(rank: int, device: torch.device) -> Iterator[None]:
    """This rank's own random stream for dropout on sharded activations. The seed is one draw from the shared CPU
    generator (the same on every rank of the group, and replayed by activation checkpointing, which restores that
    generator), mixed with the rank; the generators are restored afterwards, so replicated dropout stays in step."""
    seed = int(torch.randint(0, 2**62, (1,)).item())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        mixed = (seed * 1_000_003 + rank) % 2**63
        torch.default_generator.manual_seed(mixed)
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or 0].manual_seed(mixed)
        yield


def dropout(x: torch.Tensor, p: float, training: bool, sharded_rank: int | None) -> torch.Tensor:
    """F.dropout, on this rank's own stream when the activation is sharded (sharded_rank is not None)."""
    if not training or p == 0 or sharded_rank is None:
        return F.dropout(x, p, training)
    with sharded_rng(sharded_rank, x.device):
        return F.dropout(x, p, training)


class Dropout(nn.Module):
    """nn.Dropout whose mask comes from this rank's own stream (sharded activations)."""

    def __init__(self, p: float, group: dist.ProcessGroup):
        super().__init__()
        self.p, self.rank = p, dist.get_rank(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.rank)


def _conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """transformers' Conv1D: x @ weight (+ bias), weight in x out."""
    flat = x.reshape(-1, x.size(-1))
    out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return out.view(*x.shape[:-1], weight.size(1))


class ColumnParallelConv1D(nn.Module):
    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool, parts: int = 1):
        super().__init__()
        rank, size = group_place(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard(conv.weight, 1, parts, rank, size)
        self.bias = shard(conv.bias, 0, parts, rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        return _conv1d(x, self.weight, self.bias)


class RowParallelConv1D(nn.Module):
    def __init__(self, conv: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        rank, size = group_place(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard(conv.weight, 0, 1, rank, size)
        self.bias = conv.bias  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = _conv1d(x, self.weight, None)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group) + copy_to_tp(self.bias, self.group)
        return reduce_from_tp(partial, self.group) + self.bias


class SequenceParallelLayerNorm(nn.Module):
    """A LayerNorm on sequence shards: the same parameters, their gradients summed over the group."""

    def __init__(self, norm: nn.LayerNorm, group: dist.ProcessGroup):
        super().__init__()
        self.weight, self.bias, self.eps, self.group = norm.weight, norm.bias, norm.eps, group
        self.shape = tuple(norm.normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.shape, copy_to_tp(self.weight, self.group), copy_to_tp(self.bias, self.group),
                            self.eps)


class SequenceShardedPositions(nn.Module):
    """The position table (replicated), returning the rows of this rank's sequence shard of `positions`."""

    def __init__(self, wpe: nn.Embedding, group: dist.ProcessGroup):
        super().__init__()
        self.weight, self.group = wpe.weight, group

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return own_rows(F.embedding(positions, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) token table; a token outside them contributes zeros, and the ranks'
    partial embeddings are summed (or reduce-scattered into sequence shards)."""

    def __init__(self, wte: nn.Embedding, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        rank, size = group_place(group)
        check_vocab_split(wte.weight.size(0), size)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard(wte.weight, 0, 1, rank, size)
        self.start = rank * self.weight.size(0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_tp(partial, self.group)


class VocabParallelHead(nn.Module):
    """The LM head on this rank's vocabulary rows (the embedding's own Parameter: the tie holds). Returns this
    rank's logits (loss parallelism: the loss reads the shards) or, gathered, the whole logits of the `vocab`
    real tokens."""

    def __init__(self, weight: nn.Parameter, vocab: int, group: dist.ProcessGroup, sequence_parallel: bool,
                 loss_parallel: bool):
        super().__init__()
        self.weight, self.vocab, self.group = weight, vocab, group
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(hidden, self.group) if self.sequence_parallel else copy_to_tp(hidden, self.group)
        logits = F.linear(x, self.weight)
        if self.loss_parallel:
            return logits
        return gather_last_dim(logits, self.group)[..., :self.vocab]
