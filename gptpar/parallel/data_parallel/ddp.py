"""torch's DistributedDataParallel, the reference the other strategies are measured against."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn

from gptpar.parallel.data_parallel.base import GradSync, SyncSetup


class DDPSync(GradSync):
    name = "ddp"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.pcfg.bucket_mb, setup.group)

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup | None = None):
        super().__init__(model)
        device = next(model.parameters()).device
        self.module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
            process_group=group)
        self.comm_wait_s = None

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        with contextlib.nullcontext() if is_last_micro_step else self.module.no_sync():
            yield
