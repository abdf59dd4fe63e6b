"""torch's DistributedDataParallel, the reference the other strategies are measured against (with
parallel.grad_comm=bf16 or fp16, through torch's own compression hooks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook

from gptpar.parallel.data_parallel.base import GradSync, SyncSetup

COMPRESS_HOOKS = {"bf16": bf16_compress_hook, "fp16": fp16_compress_hook}  # parallel.grad_comm


def bf16_hook_on_any_backend(group, bucket):  # noqa: ANN001 - DDP checks the annotation object, not a string
    """torch's bf16_compress_hook, which refuses to run without NCCL, for gloo: the bucket (a dist.GradBucket) cast
    to bf16 and divided by the group's size, summed, copied back into the bucket (a future of it)."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def copied_back(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(future.value()[0])

    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(copied_back)


class DDPSync(GradSync):
    name = "ddp"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.pcfg.bucket_mb, setup.group, setup.pcfg.grad_comm, setup.local)

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup | None = None,
                 grad_comm: str = "fp32", local: frozenset[str] = frozenset()):
        super().__init__(model)
        device = next(model.parameters()).device
        if local:  # torch's own way to leave parameters out of DDP's broadcast and reduction
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(local))
        self.module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
            process_group=group)
        if grad_comm in COMPRESS_HOOKS:  # torch's own: the reference our reducers' compressed modes match
            nccl = dist.get_backend(group) == "nccl"
            hook = COMPRESS_HOOKS[grad_comm] if grad_comm == "fp16" or nccl else bf16_hook_on_any_backend
            self.module.register_comm_hook(group, hook)
        self.comm_wait_s = None

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        with contextlib.nullcontext() if is_last_micro_step else self.module.no_sync():
            yield
