"""The tensor-parallel group's collectives as autograd functions: each has its conjugate as backward.

Megatron's four, named for what they do in forward:
- `copy_to_tp`: identity forward, all-reduce backward (before a column-parallel layer, whose input is replicated);
- `reduce_from_tp`: all-reduce forward, identity backward (after a row-parallel layer, whose output is partial);
- `gather_sequence`: all-gather along the sequence forward, reduce-scatter backward (sequence parallelism,
  before a column-parallel layer);
- `reduce_scatter_sequence`: reduce-scatter along the sequence forward, all-gather backward (sequence
  parallelism, after a row-parallel layer);
and `gather_last_dim` (all-gather of vocabulary shards, backward keeps this rank's slice).

Every call adds the elements it sends over the wire, per rank and in ring terms, to `VOLUME`, so the benchmark
compares the counted traffic with its closed form. Tensors on the sequence dimension are (batch, seq, hidden).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import autograd

from gptpar.parallel.comm import comm_span

# Elements this rank put on the wire (ring algorithms: all-reduce 2(T-1)/T of the payload, all-gather and
# reduce-scatter (T-1)/T of the whole tensor), by collective; reset it to measure a step.
VOLUME: Counter[str] = Counter()


def _count(op: str, elements: int, group: dist.ProcessGroup) -> None:
    size = dist.get_world_size(group)
    VOLUME[op] += round(elements * (2 if op == "all_reduce" else 1) * (size - 1) / size)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
               ) -> torch.Tensor:
    """A summed (or `op`-reduced) copy of x over the group; not differentiable."""
    out = x.contiguous().clone()
    _count("all_reduce", out.numel(), group)
    with comm_span("all_reduce"):
        dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    parts = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * parts.size(0), *parts.shape[1:]), dtype=x.dtype, device=x.device)
    _count("all_gather", out.numel(), group)
    with comm_span("all_gather"):
        dist.all_gather_into_tensor(out, parts, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    parts = x.movedim(dim, 0).contiguous()
    out = torch.empty((parts.size(0) // size, *parts.shape[1:]), dtype=x.dtype, device=x.device)
    _count("reduce_scatter", parts.numel(), group)
    with comm_span("reduce_scatter"):
        dist.reduce_scatter_tensor(out, parts, group=group)
    return out.movedim(0, dim)


def _own_slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim)[rank].contiguous()


class _CopyToTP(autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, 1, ctx.group), None


class _ReduceScatterSequence(autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, 1, ctx.group), None


class _GatherLastDim(autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, grad.dim() - 1, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherLastDim.apply(x, group)
