"""One gradient-sync interface over three strategies, so the trainer's loop is the same for all:

    sync = make_grad_sync(model, cfg.parallel, rank_info)
    for i, (x, y) in enumerate(micro_batches):
        with sync.accumulating(is_last_micro_step=i == len(micro_batches) - 1):
            (lm_loss(sync.module(x).logits, y) / len(micro_batches)).backward()
    sync.finish()          # now every rank's .grad holds the average over ranks
    optimizer.step()       # optimizer built on sync.model.parameters()
    sync.zero_grad()       # not optimizer.zero_grad(): keeps the bucketed reducer copy-free

naive: the assignment's per-parameter all-reduce after backward; bucketed: our overlapped reducer
(gptpar.parallel.bucketed); ddp: torch's DistributedDataParallel as the reference.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from gptpar.config import ParallelConfig
from gptpar.distributed import RankInfo
from gptpar.parallel.base import GradSync, broadcast_state
from gptpar.parallel.bucketed import BucketedSync


def average_gradients(model: nn.Module) -> None:
    """All-reduce every trainable parameter's gradient, one call each, then divide by the world size.

    A trainable parameter without a gradient contributes zeros, so every rank issues the same
    sequence of collectives (a skipped one would leave the peers waiting).
    """
    size = float(dist.get_world_size())
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= size


class NaiveSync(GradSync):
    name = "naive"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        broadcast_state(model)

    def finish(self) -> None:
        start = time.perf_counter()
        average_gradients(self.model)
        self.comm_wait_s += time.perf_counter() - start


class DDPSync(GradSync):
    name = "ddp"

    def __init__(self, model: nn.Module, pcfg: ParallelConfig, info: RankInfo):
        super().__init__(model)
        device_ids = [info.device] if info.device.type == "cuda" else None
        self.module = nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                          bucket_cap_mb=pcfg.bucket_mb)
        self.comm_wait_s = None

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        with contextlib.nullcontext() if is_last_micro_step else self.module.no_sync():
            yield


def make_grad_sync(model: nn.Module, pcfg: ParallelConfig, info: RankInfo) -> GradSync:
    """The strategy named by parallel.dp_sync; a no-op with one rank. The model must already be
    on info.device and identical on all ranks up to a broadcast from rank 0 (done here)."""
    if info.world_size == 1:
        return GradSync(model)
    if pcfg.dp_sync == "naive":
        return NaiveSync(model)
    if pcfg.dp_sync == "ddp":
        return DDPSync(model, pcfg, info)
    return BucketedSync(model, bucket_mb=pcfg.bucket_mb)
