"""The tensor-parallel group's collectives as autograd functions: each has its conjugate as backward.

Megatron's four, named for what they do in forward:
- `copy_to_tp`: identity forward, all-reduce backward (before a column-parallel layer, whose input is replicated);
- `reduce_from_tp`: all-reduce forward, identity backward (after a row-parallel layer, whose output is partial);
- `gather_sequence`: all-gather along the sequence forward, reduce-scatter backward (sequence parallelism,
  before a column-parallel layer);
- `reduce_scatter_sequence`: reduce-scatter along the sequence forward, all-gather backward (sequence
  parallelism, after a row-parallel layer);
and `gather_last_dim` (all-gather of vocabulary shards, backward keeps this rank's slice) and `own_rows` (this
rank's sequence rows of a replicated tensor, backward all-gathers them).

Every call adds the elements it sends over the wire, per rank and in ring terms, to `VOLUME`, so the benchmark
compares the counted traffic with its closed form. Tensors on the sequence dimension are (batch, seq, hidden).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import autograd

from gptpar.parallel.comm import all_gather, comm_span, reduce_scatter, ring_share

# Elements this rank put on the wire (ring algorithms: all-reduce 2(T-1)/T of the payload, all-gather and
# reduce-scatter (T-1)/T of the whole tensor), by collective; reset it to measure a step.
VOLUME: Counter[str] = Counter()


def _count(op: str, elements: int, group: dist.ProcessGroup) -> None:
    VOLUME[op] += ring_share(op, elements, dist.get_world_size(group))


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
               ) -> torch.Tensor:
    """A summed (or `op`-reduced) copy of x over the group; not differentiable."""
    out = x.contiguous().clone()
    _count("all_reduce", out.numel(), group)
    with comm_span("all_reduce", group=group, nbytes=out.nbytes):
        dist.all_reduce(out, op=op, group=group)
    return out


def all_gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup, counted: bool = True) -> torch.Tensor:
    """The ranks' x concatenated along `dim`, in rank order; not differentiable. `counted=False` keeps it out of
    VOLUME (a gather outside training, e.g. making a parameter whole)."""
    size = dist.get_world_size(group)
    parts = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * parts.size(0), *parts.shape[1:]), dtype=x.dtype, device=x.device)
    if counted:
        _count("all_gather", out.numel(), group)
    all_gather(out, parts, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    parts = x.movedim(dim, 0).contiguous()
    out = torch.empty((parts.size(0) // size, *parts.shape[1:]), dtype=x.dtype, device=x.device)
    _count("reduce_scatter", parts.numel(), group)
    reduce_scatter(out, parts, group=group)
    return out.movedim(0, dim)


def _own_slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim)[rank].contiguous()


def _identity(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x.view_as(x)


def _all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_gather_dim(x, 1, group)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _reduce_scatter_dim(x, 1, group)


def _all_gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_gather_dim(x, x.dim() - 1, group)


def _own_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _own_slice(x, x.dim() - 1, group)


def _own_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _own_slice(x, 0, group)


def _all_gather_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_gather_dim(x, 0, group)


Op = Callable[[torch.Tensor, dist.ProcessGroup], torch.Tensor]


class _Conjugate(autograd.Function):
    """`forward_op` in forward, `backward_op` (its conjugate) on the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Conjugate.apply(x, group, _identity, all_reduce)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Conjugate.apply(x, group, all_reduce, _identity)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Conjugate.apply(x, group, _all_gather_sequence, _reduce_scatter_sequence)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Conjugate.apply(x, group, _reduce_scatter_sequence, _all_gather_sequence)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Conjugate.apply(x, group, _all_gather_last, _own_last)


def own_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows (dim 0) of a replicated tensor; backward all-gathers the rows' gradients, so every rank's
    gradient of x is whole (the position rows of a sequence shard)."""
    return _Conjugate.apply(x, group, _own_first, _all_gather_first)
