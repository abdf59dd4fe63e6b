"""A mixture of experts under sequence parallelism: every rank of a tp group runs the whole mixture (router, experts,
or its ep slice of them, and shared expert; llama.py keeps it whole) on its own sequence shard, so each of those
parameters' gradients holds only its shard's tokens. Summed over the group after the backward it is the whole
sequence's, equal on every rank of the group. The sum comes after the data-parallel sync, with which it commutes
(both are sums), so it is done once per step on whole gradients, and never inside a backward, where a rank whose
shard reached no expert would skip a collective its peers issue."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gptpar.models import architecture
from gptpar.parallel.comm import comm_span, count_sent


class ShardedMixtureGradients:
    """The mixture parameters this rank holds (a pipeline stage's blocks only), summed over the tp group by
    `finish`."""

    def __init__(self, model: nn.Module, net: nn.Module, group: dist.ProcessGroup) -> None:
        held = {id(p) for p in net.parameters()}
        mixtures = [block.mlp for block in architecture(model).blocks(model)]
        self.params = [p for mlp in mixtures for p in mlp.parameters() if id(p) in held]
        self.group = group

    def finish(self) -> None:
        """After the data-parallel (and expert) sync: each gradient summed over the tp group; zeros where this rank's
        shard gave none (no token reached the experts), so every rank issues the same collectives."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            with comm_span("all_reduce", group=self.group, nbytes=param.grad.nbytes):
                dist.all_reduce(param.grad, group=self.group)
            count_sent("all_reduce", param.grad.numel() * param.grad.element_size(), self.group)
