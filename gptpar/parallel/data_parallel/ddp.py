"""torch's DistributedDataParallel, the reference the other strategies are measured against, with every bucket's
reduction done by a comm hook that counts its bytes in comm.SENT: fp32 as DDP's built-in reduction does it,
parallel.grad_comm=bf16 or fp16 through torch's own compression hooks, powersgd through torch's powerSGD_hook.

PowerSGD keeps state between steps (each rank's error feedback, the warm-started P and Q of every bucket, its step
count and the random generator of its first Q): comm_state() gives it to checkpoints, each rank its own, so a resume
continues exactly. Its keys are DDP's bucket indices, so a resumed run must have the same buckets: DDP rebuilds them
after its first step in the order gradients arrived, which a resumed DDP would do one step later than the run it
continues. Under powersgd the buckets are therefore rebuilt before the first step, in parameter order (what DDP's
Join does), the same in every run; the price is that bucket 0 holds the embeddings, whose gradient comes last, so
the buckets' reductions wait for the end of backward instead of overlapping it. On gloo, whose futures complete on
its own threads, torch's hook issues a bucket's P and Q all-reduces from those threads while the next bucket's
begin from backward, so ranks could order them differently (a hang): there DDP gets one bucket.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from gptpar.parallel.comm import count_sent
from gptpar.parallel.data_parallel.base import GradSync, SyncSetup
from gptpar.strategies.data_parallel import WIRE_BYTES

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
COMPRESS_HOOKS = {"bf16": bf16_compress_hook, "fp16": fp16_compress_hook}  # parallel.grad_comm
# PowerSGD's first step: the steps before it are plain fp32 all-reduces. 2 is the least torch allows with error
# feedback and warm start (DDP's buckets settle after its first step); torch's default, 1000, suits long runs.
POWERSGD_START = 2
MEMORY = ("error_dict", "p_memory_dict", "q_memory_dict")  # PowerSGD's tensors, per bucket index


def allreduce_average(group, bucket):  # noqa: ANN001 - DDP checks the annotation object, not a string
    """What DDP does without a hook: the bucket (a dist.GradBucket) times 1/size, summed over the group (a future of
    it). The same multiplication by the reciprocal, so fp32 training is bitwise what the built-in reduction gives."""
    buffer = bucket.buffer().mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda future: future.value()[0])


def bf16_hook_on_any_backend(group, bucket):  # noqa: ANN001 - DDP checks the annotation object, not a string
    """torch's bf16_compress_hook, which refuses to run without NCCL, for gloo: the bucket (a dist.GradBucket) cast
    to bf16 and divided by the group's size, summed, copied back into the bucket (a future of it)."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def copied_back(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(future.value()[0])

    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(copied_back)


def counted(hook: Hook, element_bytes: int, group: dist.ProcessGroup | None) -> Hook:
    """`hook`, which all-reduces each bucket in `element_bytes` per element, counting what it sends."""
    def run(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotation objects, not strings
        count_sent("all_reduce", bucket.buffer().numel() * element_bytes, group)
        return hook(state, bucket)

    return run


def counted_powersgd(group: dist.ProcessGroup | None) -> Hook:
    """torch's powerSGD_hook, counting what it sends: before its first compressed step the bucket in fp32, then the
    elements it all-reduces (the tensors it leaves uncompressed, each compressed matrix's P and Q), which the hook
    adds to its own state.total_numel_after_compression."""
    def run(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotation objects, not strings
        compressing, before = state.iter >= state.start_powerSGD_iter, state.total_numel_after_compression
        future = powerSGD_hook(state, bucket)
        elements = state.total_numel_after_compression - before if compressing else bucket.buffer().numel()
        count_sent("all_reduce", elements * bucket.buffer().element_size(), group)
        return future

    return run


class DDPSync(GradSync):
    name = "ddp"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.pcfg.bucket_mb, setup.group, setup.pcfg.grad_comm, setup.local,
                   setup.pcfg.powersgd_rank)

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup | None = None,
                 grad_comm: str = "fp32", local: frozenset[str] = frozenset(), powersgd_rank: int = 1):
        super().__init__(model)
        device = next(model.parameters()).device
        nccl = dist.get_backend(group) == "nccl"
        if grad_comm == "powersgd" and not nccl:  # one bucket (see the module doc)
            bucket_mb = max(bucket_mb, sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1)
        if local:  # torch's own way to leave parameters out of DDP's broadcast and reduction
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(local))
        self.module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
            process_group=group)
        self.powersgd: PowerSGDState | None = None
        if grad_comm == "powersgd":
            self.powersgd = PowerSGDState(group, matrix_approximation_rank=powersgd_rank,
                                          start_powerSGD_iter=POWERSGD_START)
            self.module.register_comm_hook(self.powersgd, counted_powersgd(group))
            self.module.reducer._push_all_rebuilt_params()  # the first forward rebuilds the buckets in this order
        else:  # torch's own compression hooks: the reference our reducers' compressed modes match
            hook = {"fp32": allreduce_average, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook if nccl
                    else bf16_hook_on_any_backend}[grad_comm]
            self.module.register_comm_hook(group, counted(hook, WIRE_BYTES[grad_comm], group))
        self.comm_wait_s = None
        self._key = f"powersgd.rank{dist.get_rank()}"

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        with contextlib.nullcontext() if is_last_micro_step else self.module.no_sync():
            yield

    def comm_state(self) -> dict[str, Any]:
        """PowerSGD's state on this rank, one serialised value under this rank's key (its error feedback differs
        per rank; DCP loads a plain value whatever it holds, where tensors would need their shapes beforehand)."""
        if self.powersgd is None:
            return {}
        s = self.powersgd
        name, keys, pos, has_gauss, gauss = s.rng.get_state()
        state = {"iter": s.iter, "rng": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
                 **{slot: {b: t.cpu() for b, t in getattr(s, slot).items()} for slot in MEMORY}}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return {self._key: buffer.getvalue()}

    def load_comm_state(self, state: dict[str, Any]) -> None:
        if self.powersgd is None:
            return
        saved = torch.load(io.BytesIO(state[self._key]), weights_only=True)
        s, device = self.powersgd, next(self.model.parameters()).device
        s.iter = saved["iter"]
        name, keys, pos, has_gauss, gauss = saved["rng"]
        s.rng.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        for slot in MEMORY:
            setattr(s, slot, {b: t.to(device) for b, t in saved[slot].items()})
