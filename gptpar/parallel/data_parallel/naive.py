"""The assignment's data parallelism: after backward, one all-reduce per parameter."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.comm import comm_span, count_sent
from gptpar.parallel.data_parallel.base import WIRE_DTYPES, GradSync, SyncSetup, broadcast_state, synced_parameters
from gptpar.parallel.data_parallel.quantized import QuantisedAverage


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None,
                      wire: torch.dtype | None = None, local: frozenset[str] = frozenset(), quant_block: int = 0
                      ) -> None:
    """All-reduce every trainable parameter's gradient (but the `local` ones: SyncSetup), one call each, then divide
    by the group's size. With a `wire` type (parallel.grad_comm) each gradient is cast to it and divided first,
    summed in it, and the average copied back, as torch's bf16/fp16_compress_hook do; int8 averages each gradient
    in blocks of `quant_block` (quantized.py). Each call's bytes count in comm.SENT.

    A trainable parameter without a gradient contributes zeros, so every rank issues the same
    sequence of collectives (a skipped one would leave the peers waiting).
    """
    size = float(dist.get_world_size(group))
    for param in synced_parameters(model, local):
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if wire == torch.int8:
            QuantisedAverage(param.grad, group, quant_block).finish()
            continue
        count_sent("all_reduce", param.grad.numel() * (wire if wire is not None else param.grad.dtype).itemsize, group)
        if wire is None:
            with comm_span("all_reduce", group=group, nbytes=param.grad.nbytes):
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            param.grad /= size
            continue
        sent = param.grad.to(wire).div_(size)
        with comm_span("all_reduce", group=group, nbytes=sent.nbytes):
            dist.all_reduce(sent, op=dist.ReduceOp.SUM, group=group)
        param.grad.copy_(sent)


class NaiveSync(GradSync):
    name = "naive"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.group, WIRE_DTYPES[setup.pcfg.grad_comm], setup.local, setup.pcfg.quant_block)

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, wire: torch.dtype | None = None,
                 local: frozenset[str] = frozenset(), quant_block: int = 0):
        super().__init__(model)
        self.group, self.wire, self.local, self.quant_block = group, wire, local, quant_block
        broadcast_state(model, group, local)

    def finish(self) -> None:
        start = time.perf_counter()
        average_gradients(self.model, self.group, self.wire, self.local, self.quant_block)
        self.comm_wait_s += time.perf_counter() - start
