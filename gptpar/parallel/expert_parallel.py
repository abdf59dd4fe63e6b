"""Expert parallelism (parallel.ep): every block's experts split over a group of ep data-parallel ranks, each token
sent to its experts' ranks and back by all-to-all (the layout of torchtitan and DeepSpeed-MoE: the expert dimension
inside data parallelism).

Rank c of an ep group holds experts [c·E/ep, (c+1)·E/ep) of every block, in place of the whole fused tensors
(`mlp.experts.gate_up_proj` (E/ep, 2I, d), `mlp.experts.down_proj` (E/ep, d, I)); the router, attention and every
other parameter stay whole, replicated as before. A block's experts run in three moves:

1. this rank's top-k picks, sorted by expert (stably: token order within an expert); with a capacity factor the
   picks past an expert's capacity are dropped here, so no rank ever receives more than capacity per expert;
2. the picks per expert are exchanged (an all-to-all of E counts), so each rank knows how many rows each peer
   sends for each of its experts (the split sizes, read on the host: the one wait expert parallelism needs);
3. the rows go to their experts' ranks (all-to-all), each rank runs its experts on what it received (transformers'
   own experts forward on the local slice), the results come back by the inverse all-to-all and are weighted by
   their routing probabilities into their tokens' outputs.

Backward sends the gradients the same ways in reverse, so an expert's gradient on its rank sums the contributions
of every rank's tokens, each from that rank's own loss. One process's gradient is the mean over the R replicas'
losses: the dense parameters get the data-parallel strategy's average (which leaves the experts alone), the experts
are summed over the ranks that hold the same ones (EXPERT_REPLICAS, R / ep of them) and divided by R (under context
parallelism R is dp x cp: every cp rank of a replica holds the experts, run on its shard of the rows).

Checkpoints hold whole experts: each rank's slice is a DTensor sharded along dimension 0 over its ep group, so DCP
writes every slice once under the parameter's name with the whole shape, and a checkpoint loads under any ep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gptpar.models import architecture
from gptpar.parallel.comm import SENT, comm_span, count_sent, timed
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import EXPERT_REPLICAS
from gptpar.parallel.tensor_parallel.comm import all_gather_dim
from gptpar.parallel.tensor_parallel.layers import TPShard
from gptpar.parallel.tensor_parallel.state import as_dtensors, as_local

EXPERTS = "mlp.experts"  # a block's fused experts, in both mixtures transformers has
FUSED = ("gate_up_proj", "down_proj")  # their parameters, expert e being row e of each
ROWS = TPShard(dim=0, parts=1)  # how a rank's experts are a piece of the whole tensor, for checkpoints


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """`rows` split by `send` to the group's ranks in order; what each sent back in `recv` rows, concatenated. The
    rows for other ranks count in SENT, the time in SPENT."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    with comm_span("all_to_all", group=group, nbytes=rows.nbytes), timed("all_to_all", rows.device):
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    SENT["all_to_all"] += (sum(send) - send[dist.get_rank(group)]) * math.prod(rows.shape[1:]) * rows.element_size()
    return out


class _AllToAll(torch.autograd.Function):
    """`_exchange` with its gradient: backward sends each row's gradient back the way the row came."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
                ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class DispatchedExperts(nn.Module):
    """A block's experts as this rank runs them (module docstring): its slice of them, the all-to-all around them
    where an ep group shares them, the capacity cut where model.moe_capacity_factor is positive."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None, capacity_factor: float) -> None:
        super().__init__()
        names = {name for name, _ in experts.named_parameters()}
        if names != set(FUSED):
            raise TypeError(f"experts with parameters {sorted(names)}: expert parallelism splits {', '.join(FUSED)}")
        self.total, self.group = experts.num_experts, group
        self.ranks = dist.get_world_size(group) if group is not None else 1
        self.local, coord = self.total // self.ranks, dist.get_rank(group) if group is not None else 0
        self.capacity_factor = capacity_factor
        first = coord * self.local
        for name in FUSED:  # the slice replaces the whole tensor on transformers' module, which keeps running it
            whole = getattr(experts, name)
            setattr(experts, name, nn.Parameter(whole.detach()[first:first + self.local].clone()))
            setattr(self, name, getattr(experts, name))
        experts.num_experts = self.local
        object.__setattr__(self, "experts", experts)  # not a submodule: its parameters are this module's
        # Picks past capacity in the last forward: the load-balancing loss reads it right after a training forward,
        # before a recomputing backward (activation checkpointing) or an evaluation runs another.
        self.dropped = torch.zeros((), dtype=torch.long)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.size(-1)
        picks = top_k_index.reshape(-1)
        order = torch.argsort(picks, stable=True)
        expert = picks[order]
        counts = torch.bincount(picks, minlength=self.total)
        if self.capacity_factor:
            order, expert, counts = self._cut(order, expert, counts, len(hidden), k)
        rows, weights = hidden[order // k], top_k_weights.reshape(-1)[order]
        if self.group is None:
            out = self._run(rows, expert)
        else:
            received = torch.empty_like(counts)
            with comm_span("all_to_all", group=self.group, nbytes=counts.nbytes), timed("all_to_all", counts.device):
                dist.all_to_all_single(received, counts, group=self.group)  # per peer, the rows for my experts
            SENT["all_to_all"] += (self.ranks - 1) * self.local * counts.element_size()
            split = torch.stack([counts.view(self.ranks, -1).sum(1), received.view(self.ranks, -1).sum(1)]).tolist()
            send, recv = split
            arrived = _AllToAll.apply(rows, send, recv, self.group)
            local = torch.arange(self.local, device=counts.device).repeat(self.ranks)
            out = _AllToAll.apply(self._run(arrived, local.repeat_interleave(received)), recv, send, self.group)
        return torch.zeros_like(hidden).index_add_(0, order // k, (out * weights[:, None]).to(hidden.dtype))

    def _cut(self, order: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, tokens: int, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The picks within each expert's capacity, ceil(c · tokens · k / E), the earliest tokens first."""
        capacity = math.ceil(self.capacity_factor * tokens * k / self.total)
        first = torch.cumsum(counts, 0) - counts
        kept = torch.arange(len(order), device=order.device) - first[expert] < capacity
        self.dropped = (counts - capacity).clamp(min=0).sum()  # read right after the training forward
        return order[kept], expert[kept], counts.clamp(max=capacity)

    def _run(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row through its (local) expert, unweighted: transformers' forward with one pick of weight 1."""
        if not len(rows):  # no token for any of this rank's experts (the all-to-all still ran)
            return rows * 0
        ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
        return self.experts(rows, expert[:, None], ones)


class ExpertParallel:
    """A model's experts as parallel.ep and model.moe_capacity_factor run them: the DispatchedExperts of every block,
    and what the trainer does with their parameters (reduce, zero, count in the norm, checkpoint, gather whole)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, capacity_factor: float) -> None:
        self.group, self.replicas = dims.group("ep"), dims.group(EXPERT_REPLICAS)
        self.replica_count, self.coord = dims.replicas(), dims.coord("ep")
        # of the ranks holding its experts
        self.first_replica = dims.coord("dp") < dims.size("ep") and dims.coord("cp") == 0
        self.modules: dict[int, DispatchedExperts] = {}  # by block index
        for index, block in enumerate(architecture(model).blocks(model)):
            mlp = block.get_submodule(EXPERTS.rpartition(".")[0])
            module = DispatchedExperts(mlp.experts, self.group, capacity_factor)
            mlp.experts = module
            self.modules[index] = module
        self._index_params()
        self.mesh = (DeviceMesh.from_group(self.group, dims.device.type, mesh_dim_names=("ep",))
                     if self.group is not None else None)
        self.shards: dict[str, TPShard] = {}  # by name in the net, and their optimizer state's
        self.optimizer_shards: dict[str, TPShard] = {}

    def _index_params(self) -> None:
        self.params = [getattr(m, name) for m in self.modules.values() for name in FUSED]
        self.ids = {id(p) for p in self.params}

    def held_by(self, net: nn.Module) -> None:
        """Keep only the blocks whose experts `net` holds: a pipeline stage's, whose rank neither reduces nor keeps
        the other stages' experts."""
        held = {id(p) for p in net.parameters()}
        self.modules = {i: m for i, m in self.modules.items() if id(m.gate_up_proj) in held}
        self._index_params()

    @property
    def sharded(self) -> bool:
        """An ep group splits the experts (else they are whole, only dispatched for a capacity)."""
        return self.group is not None

    def name_in(self, net: nn.Module) -> frozenset[str]:
        """The expert parameters' names in `net` (the module the data-parallel strategy wraps), which it leaves to
        `finish`; also what checkpoints key them by."""
        names = frozenset(name for name, p in net.named_parameters() if id(p) in self.ids)
        self.shards = dict.fromkeys(names, ROWS)
        self.optimizer_shards = {f"state.{name}": ROWS for name in names}
        return names

    def finish(self) -> None:
        """After the dense sync: each expert's gradient summed over its replicas and divided by all R replicas (whole
        experts are the dense sync's)."""
        if not self.sharded:
            return
        for param in self.params:
            if param.grad is None:  # no token reached it: zeros, so every replica issues the same collectives
                param.grad = torch.zeros_like(param)
            if self.replicas is not None:
                with comm_span("all_reduce", group=self.replicas, nbytes=param.grad.nbytes):
                    dist.all_reduce(param.grad, group=self.replicas)
                count_sent("all_reduce", param.grad.numel() * param.grad.element_size(), self.replicas)
            param.grad /= self.replica_count

    def zero_grad(self) -> None:
        if self.sharded:
            for param in self.params:
                param.grad = None

    def counted(self, targets: list[torch.Tensor], over_replicas: bool) -> list[torch.Tensor]:
        """The gradients this rank counts in the norm: summed over its ep group, its experts and the replicated rest
        once (on the group's first rank); `over_replicas` (summed over the whole dp group, whose sync shards the
        dense gradients), the dense shards everywhere and each expert slice once (on the first of its replicas)."""
        if over_replicas:
            return [t for t in targets if id(t) not in self.ids or self.first_replica]
        return [t for t in targets if id(t) in self.ids or self.coord == 0]

    def dropped(self, blocks: Iterable[int]) -> torch.Tensor:
        """Picks dropped past capacity in the listed blocks' last forward (a capacity's forward set each)."""
        counts = [self.modules[i].dropped for i in blocks]
        return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.long)

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """An expert slice gathered whole (a collective over the ep group)."""
        return all_gather_dim(tensor.detach(), 0, self.group, counted=False) if self.group is not None else tensor

    def save(self, model: dict[str, Any], optimizer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Checkpoint state with every expert slice (and its optimizer state) a DTensor over the ep group, as our
        tensor-parallel pieces are (gptpar.parallel.tensor_parallel.state)."""
        if self.mesh is None:
            return model, optimizer
        return as_dtensors(model, self.shards, self.mesh), as_dtensors(optimizer, self.optimizer_shards, self.mesh)

    def load(self, model: dict[str, Any], optimizer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.mesh is None:
            return model, optimizer
        return as_local(model, self.shards), as_local(optimizer, self.optimizer_shards)
