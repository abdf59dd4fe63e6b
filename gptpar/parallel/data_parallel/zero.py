"""ZeRO-1 and ZeRO-2: the optimizer state (and with ZeRO-2 the gradients) sharded over the data-parallel group.

ZeRO-1 averages gradients as the bucketed reducer does (overlapped, every rank gets the whole average). Its
parameters are laid out in one flat buffer (sharded.py); each rank updates only its shard and an all-gather gives
every rank the whole updated model, so the optimizer state (AdamW's two moments, 8 bytes per parameter) is held
once over the group instead of once per rank: 4N + 4N + 8N/W bytes per rank, against 16N for plain replicas.

ZeRO-2 shards the gradients too: the parameters are laid out in buckets of about parallel.bucket_mb, each a unit
of its own flat layout, reduce-scattered as soon as backward has produced the bucket's gradients (overlapped with
the rest of backward), so each rank keeps only its shards' averaged gradients: 4N + (4N + 8N)/W, with two buckets'
full gradients in flight. After the step each bucket is all-gathered.

parallel.offload=optimizer (both): the optimizer state and the step on the host (offload.py): 16N/W bytes there (the
moments, and fp32 copies of the shard and of its gradient), the device left 4N + 4N (ZeRO-1) or 4N + 4N/W (ZeRO-2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.comm import all_gather, comm_span, count_sent
from gptpar.parallel.data_parallel.base import (
    WIRE_DTYPES,
    GradSync,
    SyncSetup,
    broadcast_state,
    local_parameters,
    synced_parameters,
)
from gptpar.parallel.data_parallel.bucketed import BucketedSync, plan_buckets
from gptpar.parallel.data_parallel.offload import HostShards
from gptpar.parallel.data_parallel.sharded import ShardedOptimizer, Unit, UnitSync


class ZeroOneSync(ShardedOptimizer, BucketedSync):
    name = "zero1"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.pcfg.bucket_mb, setup.group, WIRE_DTYPES[setup.pcfg.grad_comm], setup.local,
                   setup.pcfg.offload == "optimizer")

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup | None = None,
                 wire: torch.dtype | None = None, local: frozenset[str] = frozenset(), offload: bool = False):
        BucketedSync.__init__(self, model, bucket_mb, group, wire, local)  # broadcasts rank 0's parameters first
        self.rank = dist.get_rank(group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in local]
        self.local = local_parameters(model, local)  # parallel.ep's expert slices, stepped whole (ShardedOptimizer)
        self.flat = Unit(named, self.world_size, self.rank, named[0][1].device, separate_shard=False)
        self.pieces, self.shard_size = self.flat.pieces, self.flat.shard_size
        # Each piece's gradient: its slice of the parameter's .grad, which the reducer keeps as the same view
        # of its bucket across steps (it re-points .grad at that view after every finish and zero_grad).
        for piece in self.pieces:
            piece.tensor.grad = piece.param.grad.view(-1)[piece.start:piece.end]
        self.host = HostShards([self.flat]) if offload else None  # parallel.offload=optimizer (offload.py)

    def after_step(self) -> None:
        """Every rank's updated shard to every rank."""
        self.to_device()
        all_gather(self.flat.full, self.flat.shard.clone(), group=self.group)
        count_sent("all_gather", self.flat.nbytes, self.group)


class ZeroTwoSync(UnitSync):
    name = "zero2"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.pcfg.bucket_mb, setup.group, setup.local, WIRE_DTYPES[setup.pcfg.grad_comm],
                   setup.pcfg.quant_block, setup.pcfg.offload == "optimizer")

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup,
                 local: frozenset[str] = frozenset(), wire: torch.dtype | None = None, quant_block: int = 0,
                 offload: bool = False):
        super().__init__(model, group, wire, quant_block)
        broadcast_state(model, group, local)
        names = {id(p): n for n, p in model.named_parameters()}
        self.local = local_parameters(model, local)
        buckets = plan_buckets(synced_parameters(model, local), int(bucket_mb * 2**20))
        device = next(model.parameters()).device
        self.units = [Unit([(names[id(p)], p) for p in bucket], self.world_size, self.rank, device,
                           separate_shard=False) for bucket in buckets]
        self._hook_units()
        self.host = HostShards(self.units) if offload else None  # parallel.offload=optimizer (offload.py)

    def after_step(self) -> None:
        """Every rank's updated shards to every rank, bucket by bucket (all started, then all waited for)."""
        self.to_device()
        works = [all_gather(u.full, u.shard.clone(), group=self.group, async_op=True) for u in self.units]
        count_sent("all_gather", sum(u.nbytes for u in self.units), self.group)
        for work in works:
            with comm_span("all_gather", phase="wait", group=self.group):
                work.wait()
