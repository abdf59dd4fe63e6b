"""The assignment's data parallelism: after backward, one all-reduce per parameter."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.comm import comm_span
from gptpar.parallel.data_parallel.base import GradSync, SyncSetup, broadcast_state


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce every trainable parameter's gradient, one call each, then divide by the group's size.

    A trainable parameter without a gradient contributes zeros, so every rank issues the same
    sequence of collectives (a skipped one would leave the peers waiting).
    """
    size = float(dist.get_world_size(group))
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        with comm_span("all_reduce"):
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
        param.grad /= size


class NaiveSync(GradSync):
    name = "naive"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.group)

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__(model)
        self.group = group
        broadcast_state(model, group)

    def finish(self) -> None:
        start = time.perf_counter()
        average_gradients(self.model, self.group)
        self.comm_wait_s += time.perf_counter() - start
