"""ZeRO-1 and ZeRO-2: the optimizer state (and with ZeRO-2 the gradients) sharded over the data-parallel group.

ZeRO-1 averages gradients as the bucketed reducer does (overlapped, every rank gets the whole average).
Each rank then updates only its shard of the parameters and an all-gather gives every rank the whole
updated model, so the optimizer state (AdamW's two moments, 8 bytes per parameter) is held once over
the group instead of once per rank: 4N + 4N + 8N/W bytes per rank, against 16N for plain replicas.
ZeRO-2 reduce-scatters the gradients instead, so each rank keeps only its shard's averaged gradient
after the step: 4N + (4N + 8N)/W. Here the reduce-scatter runs once after the last backward of the
step, not overlapped with it, and the full gradients exist until then.

Layout: the parameters are re-pointed into one flat buffer, padded to a multiple of the group size W;
rank r owns the r-th W-th of it. Its optimizer steps *pieces*: views of the flat buffer where a parameter
overlaps the shard, each with its parameter's weight-decay class. A piece's gradient is the matching
view of its parameter's averaged gradient, so nothing is copied. Checkpoints store each piece's state
under `<parameter name>[<start>:<end>]`, the range within the flattened parameter, which names the same
piece on every restart with the same W.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.data_parallel.base import GradSync, broadcast_state
from gptpar.parallel.data_parallel.bucketed import BucketedSync

# torch 2.13 renamed these collectives (the old names warn); older torch, down to the declared 2.4, has only the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedOptimizer:
    """The flat parameter layout, this rank's pieces of it, their optimizer state and the all-gather
    after the step: what ZeRO-1 and ZeRO-2 share. `world_size` and `group` come from the sync."""

    world_size: int
    group: dist.ProcessGroup | None
    shards_optimizer = True

    def _shard(self, model: nn.Module) -> None:
        self.rank = dist.get_rank(self.group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        total = sum(p.numel() for _, p in named)
        self.shard_size = -(-total // self.world_size)
        first = named[0][1]
        self.flat = torch.zeros(self.shard_size * self.world_size, dtype=first.dtype, device=first.device)
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        self.pieces: list[tuple[str, nn.Parameter, nn.Parameter, int, int]] = []  # name, param, piece, start, end
        self.params = [p for _, p in named]
        self._offsets: dict[int, int] = {}  # id(parameter) -> its offset in the flat buffer
        offset = 0
        with torch.no_grad():
            for name, p in named:
                self._offsets[id(p)] = offset
                region = self.flat[offset:offset + p.numel()]
                region.copy_(p.view(-1))
                p.data = region.view_as(p)
                start, end = max(lo, offset) - offset, min(hi, offset + p.numel()) - offset
                if start < end:
                    self.pieces.append((name, p, nn.Parameter(region[start:end]), start, end))
                offset += p.numel()

    def optimizer_params(self) -> list[tuple[torch.Tensor, bool]]:
        return [(piece, param.dim() >= 2) for _, param, piece, _, _ in self.pieces]

    def after_step(self) -> None:
        """Every rank's updated shard to every rank."""
        lo = self.rank * self.shard_size
        _all_gather(self.flat, self.flat[lo:lo + self.shard_size].clone(), group=self.group)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state of this rank's pieces, keyed by parameter name and range (see the module doc)."""
        return {f"{name}[{start}:{end}]": optimizer.state[piece]
                for name, _, piece, start, end in self.pieces if piece in optimizer.state}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        for name, _, piece, start, end in self.pieces:
            key = f"{name}[{start}:{end}]"
            if key in state:
                optimizer.state[piece] = state[key]


class ZeroOneSync(ShardedOptimizer, BucketedSync):
    name = "zero1"

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup | None = None):
        BucketedSync.__init__(self, model, bucket_mb, group)  # broadcasts rank 0's parameters to the group first
        self._shard(model)
        # Each piece's gradient: its slice of the parameter's .grad, which the reducer keeps as the same view
        # of its bucket across steps (it re-points .grad at that view after every finish and zero_grad).
        for _, param, piece, start, end in self.pieces:
            piece.grad = param.grad.view(-1)[start:end]


class ZeroTwoSync(ShardedOptimizer, GradSync):
    name = "zero2"

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None):
        GradSync.__init__(self, model)
        self.group, self.world_size = group, dist.get_world_size(group)
        broadcast_state(model, group)
        self._shard(model)
        self.grad_shard = torch.zeros(self.shard_size, dtype=self.flat.dtype, device=self.flat.device)
        lo = self.rank * self.shard_size
        for _, param, piece, start, end in self.pieces:  # each piece's gradient: its slice of the shard
            offset = self._offsets[id(param)] + start - lo
            piece.grad = self.grad_shard[offset:offset + end - start]

    def finish(self) -> None:
        """Sum the gradients into each rank's shard (reduce-scatter) and drop the full ones."""
        start = time.perf_counter()
        full = torch.zeros_like(self.flat)
        for param in self.params:
            if param.grad is not None:
                offset = self._offsets[id(param)]
                full[offset:offset + param.numel()].copy_(param.grad.view(-1))
                param.grad = None
        full.div_(self.world_size)
        _reduce_scatter(self.grad_shard, full, group=self.group)
        self.comm_wait_s += time.perf_counter() - start

    def clip_targets(self) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
        return [piece for _, _, piece, _, _ in self.pieces], self.group

    def zero_grad(self) -> None:
        self.grad_shard.zero_()
        self.model.zero_grad(set_to_none=True)
