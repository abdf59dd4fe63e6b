"""parallel.offload=optimizer for ZeRO-1 and ZeRO-2: the optimizer state and the optimizer step on the host.

Each unit's shard gets an fp32 master copy on the host, with a gradient buffer beside it; the optimizer steps pieces
of the master copy (the same pieces, by parameter and range, as the device shard's), so AdamW's moments are created
on the host too. The device keeps its parameters and its gradient shard: the reduce-scatter (or ZeRO-1's buckets)
and the clip run there as without offload. Around the step: each piece's clipped gradient is copied device -> host
(`to_host`), the step runs on the host, and each updated shard is copied host -> device (`to_device`) before the
all-gather that gives every rank the whole model.

On CUDA the host buffers are pinned (page-locked), so the copies are asynchronous (non_blocking) and the host waits
for the gradients once before its step; a CPU-only torch has no pinned memory, and there host and device are one
memory: the copies run the same way (separate host tensors), synchronously, and the memory record still counts
what moved (`host_bytes`).
"""

from __future__ import annotations

import torch
from torch import nn

from gptpar.parallel.data_parallel.sharded import Piece, Unit


class HostShards:
    """The host copies of `units`' shards and the pieces the optimizer steps on them (`pieces`, in the units'
    order)."""

    def __init__(self, units: list[Unit]):
        device = units[0].shard.device
        self.pinned = device.type == "cuda"  # page-locked host memory exists only beside a CUDA device
        self.device = device
        self.units = units
        self.shards = [self._empty(u.shard) for u in units]
        self.grads = [self._empty(u.shard).zero_() for u in units]
        self.pieces: list[Piece] = []
        self.device_pieces: list[Piece] = []
        for u, shard, grad in zip(units, self.shards, self.grads, strict=True):
            for piece in u.pieces:
                span = slice(piece.at, piece.at + piece.end - piece.start)
                host = nn.Parameter(shard[span])
                host.grad = grad[span]
                self.pieces.append(piece._replace(tensor=host))
                self.device_pieces.append(piece)
        self.pull()

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pinned)

    @torch.no_grad()
    def pull(self) -> None:
        """The host masters from the device shards (at the start, and after a checkpoint loaded the parameters)."""
        for u, shard in zip(self.units, self.shards, strict=True):
            shard.copy_(u.shard)

    @torch.no_grad()
    def to_host(self) -> None:
        """Each piece's (reduced, clipped) gradient to its host buffer; returns once the host may read them."""
        for host, piece in zip(self.pieces, self.device_pieces, strict=True):
            host.tensor.grad.copy_(piece.tensor.grad, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def to_device(self) -> None:
        """The stepped masters back into the device shards, queued before the all-gather that reads them."""
        for u, shard in zip(self.units, self.shards, strict=True):
            u.shard.copy_(shard, non_blocking=self.pinned)

    def tensors(self) -> list[torch.Tensor]:
        """What lives on the host: the masters (the pieces view them; their gradients and AdamW's state go with
        them)."""
        return list(self.shards)
