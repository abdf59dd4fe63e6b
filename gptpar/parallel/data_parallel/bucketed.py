"""Our overlapped gradient reducer: flat buckets all-reduced asynchronously during backward.

Per-parameter all-reduces pay a latency per call; one all-reduce after backward leaves the
network idle while backward computes. Buckets of ~bucket_mb each, filled in reverse parameter
order (roughly the order backward produces gradients), are launched the moment their last
gradient is accumulated, so communication of the late layers overlaps backward of the early ones.

Invariants:
- Buckets are launched strictly in index order on every rank: collectives are matched by order,
  so a bucket that is ready early waits for its predecessors instead of overtaking them.
- A post-accumulate-grad hook fires once per parameter per backward, after every use of the
  parameter has been accumulated (GPT-2's tied wte/lm_head weight is one Parameter: one call).
- Each .grad is a view of its bucket slice, so backward accumulates straight into the buckets and
  the hooks copy nothing, as long as gradients are reset with zero_grad() here (which zeroes the
  buckets) rather than set to None; if they are set to None, the hooks copy the fresh gradients in.
- finish() launches any bucket still missing gradients (a parameter unused this step contributes
  its existing .grad or zeros), waits, and points each .grad at its averaged slice again.
- With parallel.grad_comm=bf16 or fp16 a launched bucket is cast to that type and divided there, summed in it,
  and copied back into the fp32 bucket once it arrives: half the bytes on the wire, and element for element what
  torch's bf16/fp16_compress_hook compute for DDP. With int8 a launched bucket is quantised and its all-to-all issued
  (quantized.py); finish() completes each bucket's average in order (its shard reduced, then its all-gather).
- Every launched bucket counts its bytes in comm.SENT.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.comm import comm_span, count_sent
from gptpar.parallel.data_parallel.base import WIRE_DTYPES, GradSync, SyncSetup, broadcast_state, synced_parameters
from gptpar.parallel.data_parallel.quantized import QuantisedAverage
from gptpar.parallel.flight import skips_planted_collective


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]  # views[i] is params[i]'s slice of buffer, shaped like the parameter
    ready: list[bool] = field(default_factory=list)
    work: dist.Work | QuantisedAverage | None = None  # its all-reduce, or its int8 average, in flight
    sent: torch.Tensor | None = None  # the bucket in parallel.grad_comm's type while it is on the wire

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.work = None
        self.sent = None


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group trainable parameters, last to first, into runs of about bucket_bytes of one dtype/device."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for param in reversed([p for p in params if p.requires_grad]):
        current = groups[-1] if groups else None
        if (current is None or size >= bucket_bytes or current[0].dtype != param.dtype
                or current[0].device != param.device):
            groups.append([param])
            size = 0
        else:
            current.append(param)
        size += param.numel() * param.element_size()
    return groups


def _make_bucket(params: list[nn.Parameter]) -> _Bucket:
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    bucket = _Bucket(params, buffer, views)
    bucket.reset()
    return bucket


class BucketedSync(GradSync):
    name = "bucketed"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.pcfg.bucket_mb, setup.group, WIRE_DTYPES[setup.pcfg.grad_comm], setup.local,
                   setup.pcfg.quant_block)

    def __init__(self, model: nn.Module, bucket_mb: float, group: dist.ProcessGroup | None = None,
                 wire: torch.dtype | None = None, local: frozenset[str] = frozenset(), quant_block: int = 0):
        super().__init__(model)
        self.group, self.wire, self.quant_block = group, wire, quant_block
        broadcast_state(model, group, local)
        self.world_size = dist.get_world_size(group)
        groups = plan_buckets(synced_parameters(model, local), int(bucket_mb * 2**20))
        self.buckets = [_make_bucket(group) for group in groups]
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                if param.grad is not None:
                    view.copy_(param.grad)
        self._alias_grads()
        self._next = 0  # index of the first bucket not yet launched
        self._sync = True
        self._handles = [
            param.register_post_accumulate_grad_hook(self._hook(b, slot))
            for b, bucket in enumerate(self.buckets) for slot, param in enumerate(bucket.params)
        ]

    def _hook(self, b: int, slot: int):
        def on_grad_ready(param: torch.Tensor) -> None:
            if self._sync:
                self._mark_ready(b, slot)

        return on_grad_ready

    def _mark_ready(self, b: int, slot: int) -> None:
        bucket = self.buckets[b]
        if b < self._next:
            raise RuntimeError("bucketed sync: a second backward ran before finish(); call finish() "
                               "once per optimizer step, or use accumulating(False) for earlier micro-steps")
        self._stage(bucket, slot)
        self._launch_ready()

    def _stage(self, bucket: _Bucket, slot: int) -> None:
        """Put the parameter's gradient / world_size (zeros if it has none) into its bucket slice.

        Dividing while copying saves a pass over the bucket; the all-reduce then only sums. A compressed bucket is
        divided after its cast, at launch, as torch's hooks do.
        """
        param, view = bucket.params[slot], bucket.views[slot]
        divisor = self.world_size if self.wire is None else 1
        if param.grad is None:
            view.zero_()
        elif param.grad.data_ptr() == view.data_ptr():
            if divisor != 1:
                view.div_(divisor)
        else:
            torch.div(param.grad, divisor, out=view)
        bucket.ready[slot] = True

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and all(self.buckets[self._next].ready):
            bucket = self.buckets[self._next]
            self._next += 1
            if self.wire == torch.int8:
                bucket.work = QuantisedAverage(bucket.buffer, self.group, self.quant_block)
                continue
            if self.wire is not None:
                bucket.sent = bucket.buffer.to(self.wire).div_(self.world_size)
            sent = bucket.buffer if bucket.sent is None else bucket.sent
            if skips_planted_collective():  # a test's planted mismatch: never in a real run
                continue
            count_sent("all_reduce", sent.numel() * sent.element_size(), self.group)
            with comm_span("all_reduce", phase="issue", group=self.group, nbytes=sent.nbytes):
                bucket.work = dist.all_reduce(sent, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        self._sync = is_last_micro_step
        try:
            yield
        finally:
            self._sync = True

    def finish(self) -> None:
        for bucket in self.buckets[self._next:]:
            for slot, done in enumerate(bucket.ready):
                if not done:
                    self._stage(bucket, slot)
        self._launch_ready()
        start = time.perf_counter()
        for bucket in self.buckets:
            if isinstance(bucket.work, QuantisedAverage):
                bucket.work.finish()
                continue
            if bucket.work is None:  # skipped (skips_planted_collective)
                continue
            with comm_span("all_reduce", phase="wait", group=self.group):
                bucket.work.wait()
            if bucket.sent is not None:
                bucket.buffer.copy_(bucket.sent)
        self.comm_wait_s += time.perf_counter() - start
        for bucket in self.buckets:
            bucket.reset()
        self._next = 0
        self._alias_grads()

    def zero_grad(self) -> None:
        """Zero the buckets, keeping every .grad a view of its bucket (no allocation, no copies)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
        self._alias_grads()

    def _alias_grads(self) -> None:
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                param.grad = view
