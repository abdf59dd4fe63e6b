"""parallel.param_comm and parallel.hpz: how fsdp's parameter all-gathers cross the wire (ZeRO++'s qwZ and hpZ).

A unit's parameters are gathered from every rank's shard of its flat buffer (sharded.Unit). `ParamWire` says what a
shard is sent as (its payload) and how the gathered payloads become the flat buffer:
- fp32: the shard itself, gathered straight into the buffer (no copy: what fsdp did before param_comm existed);
- bf16: the shard cast to bf16, gathered, cast back into the fp32 buffer;
- int8 (qwZ): the shard padded with zeros to whole blocks of parallel.quant_block values and quantised as qgZ
  quantises a gradient (quantized.quantise: one fp32 scale per block); the int8 blocks and the scales are gathered
  and dequantised into the buffer.
Every rank writes its own shard's region from the gathered payload too, not from its exact fp32 shard. Otherwise
each rank would compute with its own part exact and the others' rounded, W slightly different models whose
gradients average to no model's; decoding the same bytes, every rank computes with the same weights bit for bit.
The optimizer's shard (the master copy) stays fp32 and exact: the rounding is redone from it at every gather and
never accumulates into the weights.

Per rank and gather of a unit of P values over g ranks (shards of S = P/g), in ring terms: fp32 4P(g-1)/g, bf16
2P(g-1)/g, int8 g(Sb + 4Sb/B)(g-1)/g with Sb = S rounded up to whole blocks of B.

hpZ (`Secondary`): a unit's gather over the whole data-parallel group also keeps this rank's 1/L of the gathered
payload, L the size of its node group (parallel.hpz_node_size). The L ranks of a node then hold the whole payload
between them, and every later gather of the unit until the optimizer step (backward's, and the forwards of further
micro-steps) gathers those L slices within the node instead of the g shards across nodes. The payload is kept as it
came over the wire, so a node's gather decodes the very bytes the group's did: the same weights bit for bit,
whichever gather made them. It costs each rank 1/L of every unit's payload, held for the run
(strategies.data_parallel.hpz_bytes), and nothing to checkpoint: it is dropped at every optimizer step and rebuilt by
the next gather over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gptpar.parallel.comm import all_gather, comm_span, count_sent
from gptpar.parallel.data_parallel.quantized import dequantise, padded_length, quantise

INTRA = "all_gather_intra"  # comm_bytes' key for the gathers within a node group (parallel.hpz)


class ParamWire:
    """parallel.param_comm for a unit sharded over `world` ranks: each shard's payload and the decoding of the
    gathered payloads into the unit's flat fp32 buffer."""

    def __init__(self, kind: str, world: int, block: int = 0):
        self.kind, self.world, self.block = kind, world, block

    def encode(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """What this rank sends of its shard."""
        if self.kind == "fp32":
            return [shard]
        if self.kind == "bf16":
            return [shard.to(torch.bfloat16)]
        padded = torch.zeros(padded_length(shard.numel(), 1, self.block), dtype=torch.float32, device=shard.device)
        padded[:shard.numel()] = shard
        blocks, scales = quantise(padded, self.block)
        return [blocks.view(-1), scales]

    def landing(self, parts: list[torch.Tensor], size: int, full: torch.Tensor) -> list[torch.Tensor]:
        """Where a gather of `parts` from `size` ranks lands: the flat buffer itself for fp32, else new tensors."""
        if self.kind == "fp32":
            return [full]
        return [torch.empty(part.numel() * size, dtype=part.dtype, device=part.device) for part in parts]

    def decode(self, received: list[torch.Tensor], full: torch.Tensor) -> None:
        """The whole payload (every rank's, in rank order) into the flat buffer."""
        if self.kind == "bf16":
            full.copy_(received[0])
        elif self.kind == "int8":
            blocks, scales = received
            values = dequantise(blocks.view(scales.numel(), self.block), scales).view(self.world, -1)
            shard = full.numel() // self.world
            full.view(self.world, shard).copy_(values[:, :shard])


class Secondary:
    """hpZ's copy of this rank's 1/L of a unit's gathered payload (L: its node group's size), and whether it holds
    the parameters as they are now (from the last gather over the data-parallel group, before any optimizer step)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.parts: list[torch.Tensor] = []
        self.valid = False

    def keep(self, received: list[torch.Tensor]) -> None:
        """This rank's slice of the payload a gather over the group received (every rank's, in rank order)."""
        slices = [whole.view(self.size, -1)[self.rank] for whole in received]
        if not self.parts:  # allocated at the first gather, reused after
            self.parts = [piece.clone() for piece in slices]
        else:
            for part, piece in zip(self.parts, slices, strict=True):
                part.copy_(piece)
        self.valid = True

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)


class Gather:
    """One all-gather of a unit's parameters in flight, issued when built and counted in comm_bytes under `op`
    (all_gather over the data-parallel group, INTRA within a node); wait() writes them into the flat buffer and, for
    a gather over the group under hpZ, keeps the node's slice (`keep`)."""

    def __init__(self, wire: ParamWire, parts: list[torch.Tensor], full: torch.Tensor, group: dist.ProcessGroup,
                 op: str = "all_gather", keep: Secondary | None = None):
        self.wire, self.full, self.keep, self.group = wire, full, keep, group
        self.received = wire.landing(parts, dist.get_world_size(group), full)
        self.works = [all_gather(whole, part, group=group, async_op=True)
                      for whole, part in zip(self.received, parts, strict=True)]
        count_sent(op, sum(whole.numel() * whole.element_size() for whole in self.received), group)

    def wait(self) -> None:
        for work in self.works:  # one wait per issue, as the flight recorder pairs them
            with comm_span("all_gather", phase="wait", group=self.group):
                work.wait()
        self.wire.decode(self.received, self.full)
        if self.keep is not None:
            self.keep.keep(self.received)
