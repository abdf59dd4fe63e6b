"""parallel.grad_comm=int8: a flat gradient averaged over the group in blockwise int8, ZeRO++'s qgZ scheme.

Each rank quantises its gradient in blocks of parallel.quant_block values, one fp32 scale per block (its largest
magnitude / 127, rounded to nearest); an all-to-all sends every rank the int8 blocks and scales of its shard from all
ranks (a reduce-scatter built from an all-to-all, so nothing is summed in int8); each rank dequantises them, sums its
shard in fp32, divides by the group size and quantises the average again; an all-gather of those
int8 blocks and scales gives every rank the whole average, which every rank dequantises from the same bytes, so the
replicas stay bitwise equal. The gradient is padded with zeros to a multiple of group size x block.

Per rank and call, in ring terms, for P padded values on g ranks with blocks of B: the all-to-all sends
(P + 4P/B)(g-1)/g bytes and the all-gather as much again, 2(g-1)/g (P + 4P/B) in all, against 2(g-1)/g 4n in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gptpar.parallel.comm import all_gather, comm_span, count_sent

LEVELS = 127  # symmetric int8: -127..127


def quantise(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` (a multiple of `block` long) as int8 blocks and one fp32 scale per block (0 for a block of zeros)."""
    blocks = values.view(-1, block)
    scales = blocks.abs().amax(dim=1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return blocks.div(safe[:, None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int8), scales


def dequantise(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return blocks.float() * scales[..., None]


def padded_length(numel: int, size: int, block: int) -> int:
    """`numel` rounded up to a multiple of size x block: every rank's shard is whole blocks."""
    unit = size * block
    return -(-numel // unit) * unit


def exchange_quantised(padded: torch.Tensor, block: int, group: dist.ProcessGroup | None, span: str = "all_to_all"
                       ) -> tuple[torch.Tensor, torch.Tensor, list[dist.Work]]:
    """`padded` (g equal parts of whole blocks) quantised, and part r sent to rank r by all-to-all, issued (in a
    profiler span named `span`, the op it implements): the int8 blocks and scales that will arrive from every rank,
    and the works to wait for. The bytes for other ranks count in SENT as all-to-all."""
    blocks, scales = quantise(padded, block)
    received_blocks, received_scales = torch.empty_like(blocks), torch.empty_like(scales)
    with comm_span(span, phase="issue", group=group, nbytes=blocks.nbytes + scales.nbytes):
        works = [dist.all_to_all_single(received, sent, group=group, async_op=True)
                 for received, sent in ((received_blocks, blocks), (received_scales, scales))]
    count_sent("all_to_all", blocks.numel() + scales.numel() * scales.element_size(), group)
    return received_blocks, received_scales, works


class QuantisedAverage:
    """The average over `group` of a flat fp32 gradient, in flight: built, it has quantised the gradient and issued
    the all-to-all; finish() waits for it, reduces this rank's shard, all-gathers and writes the average into `flat`."""

    def __init__(self, flat: torch.Tensor, group: dist.ProcessGroup | None, block: int):
        self.flat, self.group, self.block = flat, group, block
        self.size = dist.get_world_size(group)
        padded = torch.zeros(padded_length(flat.numel(), self.size, block), dtype=torch.float32, device=flat.device)
        padded[:flat.numel()] = flat.view(-1)
        self.blocks, self.scales, self.works = exchange_quantised(padded, block, group)

    def finish(self) -> None:
        with comm_span("all_to_all", phase="wait", group=self.group):
            for work in self.works:
                work.wait()
        shard_blocks = self.blocks.numel() // self.block // self.size
        received = dequantise(self.blocks.view(self.size, shard_blocks, self.block),
                              self.scales.view(self.size, shard_blocks))
        average = received.sum(dim=0).div_(self.size)
        blocks, scales = quantise(average.view(-1), self.block)
        whole_blocks = torch.empty((self.size * shard_blocks, self.block), dtype=torch.int8, device=blocks.device)
        whole_scales = torch.empty(self.size * shard_blocks, dtype=scales.dtype, device=scales.device)
        all_gather(whole_blocks, blocks, group=self.group)
        all_gather(whole_scales, scales, group=self.group)
        count_sent("all_gather", whole_blocks.numel() + whole_scales.numel() * whole_scales.element_size(), self.group)
        self.flat.view(-1).copy_(dequantise(whole_blocks, whole_scales).view(-1)[:self.flat.numel()])


class QuantisedReduceScatter:
    """The sum over `group` of each rank's shard of a flat gradient (already divided by the group size), in flight:
    qgZ's reduce-scatter for the sharding syncs (zero2, fsdp), whose shards are `flat`'s g equal rows. Each row is
    padded to whole blocks and quantised; one all-to-all sends row r to rank r; wait() dequantises what arrived and
    sums it in fp32 into `out` (this rank's shard). Nothing is summed in int8 and nothing is requantised: the shard
    stays on this rank. Per rank it sends (g-1)/g of the padded int8 rows and their scales."""

    def __init__(self, flat: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None, block: int):
        self.out, self.size, self.block = out, dist.get_world_size(group), block
        rows = flat.view(self.size, -1)
        width = padded_length(rows.shape[1], 1, block)
        padded = torch.zeros((self.size, width), dtype=torch.float32, device=flat.device)
        padded[:, :rows.shape[1]] = rows
        self.blocks, self.scales, self.works = exchange_quantised(padded.view(-1), block, group, "reduce_scatter")

    def wait(self) -> None:
        for work in self.works:  # inside the sync's reduce_scatter wait span, which pairs with the issue's
            work.wait()
        per_rank = self.scales.numel() // self.size
        received = dequantise(self.blocks.view(self.size, per_rank, self.block), self.scales.view(self.size, per_rank))
        self.out.copy_(received.sum(dim=0).view(-1)[:self.out.numel()])
