"""The flat-shard layout and gradient reduce-scatter that ZeRO-1, ZeRO-2 and fsdp share.

Layout: a group of parameters (all of them for ZeRO-1, a bucket for ZeRO-2, a block for fsdp) is laid end to end
in one flat buffer padded to a multiple of the group size W; rank r owns the r-th W-th of it, its *shard*. The
optimizer steps *pieces*: views of the shard where a parameter overlaps it, each with its parameter's weight-decay
class, so nothing is copied into or out of the optimizer. Checkpoints store each piece's optimizer state (and under
fsdp the piece itself) as `<parameter name>[<start>:<end>]`, the range within the flattened parameter, which names
the same piece on every restart with the same W.

Gradients of ZeRO-2 and fsdp (`UnitSync`): a unit's gradients accumulate into a flat buffer of its layout, which
is reduce-scattered (averaged) as soon as the unit's last parameter gradient is in (post-accumulate-grad hooks), so
the reduction of one unit overlaps the backward of the next; the result is added into the unit's gradient shard,
each piece's gradient a view of it. One reduce-scatter is outstanding at a time, bounding the full gradients in
flight to two units' (the one accumulating, the one reducing). Every micro-step reduces, so gradient accumulation
keeps no full gradient between micro-steps. The order in which units complete is the same on every rank (the same
graph runs backward), which matches the collectives. With parallel.grad_comm=bf16 or fp16 the flat gradient is cast
to that type for the reduce-scatter and summed in it; with int8 it goes as ZeRO++'s qgZ
(quantized.QuantisedReduceScatter); either way the shard's gradient is accumulated in fp32.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.comm import comm_span, count_sent, reduce_scatter
from gptpar.parallel.data_parallel.base import GradSync, InitialValue
from gptpar.parallel.data_parallel.quantized import QuantisedReduceScatter

if TYPE_CHECKING:
    from gptpar.parallel.data_parallel.param_comm import Gather


class Piece(NamedTuple):
    """Where a parameter overlaps this rank's shard: `tensor` (a Parameter the optimizer steps) views the shard at
    offset `at` and holds elements [start, end) of the flattened parameter `param`, called `name`."""

    name: str
    param: nn.Parameter
    tensor: nn.Parameter
    start: int
    end: int
    at: int

    @property
    def key(self) -> str:
        """The checkpoint key: the parameter and range, the same on every restart with the same world size."""
        return f"{self.name}[{self.start}:{self.end}]"


def shard_pieces(named: list[tuple[str, nn.Parameter]], lo: int, shard: torch.Tensor) -> list[Piece]:
    """The pieces of `named`, laid end to end from offset 0, that fall into [lo, lo + len(shard)), which `shard`
    holds."""
    pieces, offset, hi = [], 0, lo + shard.numel()
    for name, p in named:
        start, end = max(lo, offset) - offset, min(hi, offset + p.numel()) - offset
        if start < end:
            at = offset + start - lo
            pieces.append(Piece(name, p, nn.Parameter(shard[at:at + end - start]), start, end, at))
        offset += p.numel()
    return pieces


class HostCopies(Protocol):
    """What a sharded optimizer asks of parallel.offload=optimizer's host copies of its shards (offload.py's
    HostShards, which builds on the pieces here)."""

    pieces: list[Piece]

    def pull(self) -> None: ...

    def to_host(self) -> None: ...

    def to_device(self) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...


class ShardedOptimizer:
    """The optimizer over this rank's pieces and their checkpointed state. `pieces` is set by the sync; `local`, by
    name, the parameters it leaves whole (parallel.ep's expert slices, which no replica of this group shares): they
    are stepped as they are and their state is keyed as torch's flat optimizer state dict keys it,
    `state.<name>.<field>`, where gptpar.parallel.expert_parallel finds it. Under parallel.offload=optimizer (`host`,
    offload.py) the optimizer steps the host copies of the pieces instead, keyed the same; gradients and the clip stay
    with the device pieces."""

    pieces: list[Piece]
    local: list[tuple[str, nn.Parameter]] = []
    host: HostCopies | None = None
    shards_optimizer = True

    @property
    def stepped(self) -> list[Piece]:
        """The pieces the optimizer steps: the device's, or their host copies under offload."""
        return self.host.pieces if self.host is not None else self.pieces

    def optimizer_params(self) -> list[tuple[torch.Tensor, bool]]:
        return [(piece.tensor, piece.param.dim() >= 2) for piece in self.stepped] + [(p, p.dim() >= 2)
                                                                                    for _, p in self.local]

    def owners(self) -> dict[int, nn.Parameter]:
        return {id(piece.tensor): piece.param for piece in self.pieces}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state of this rank's pieces, keyed by parameter name and range (see the module doc), and of
        its local parameters."""
        state = {piece.key: optimizer.state[piece.tensor] for piece in self.stepped
                 if piece.tensor in optimizer.state}
        return state | {f"state.{name}.{field}": value for name, p in self.local
                        for field, value in optimizer.state.get(p, {}).items()}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """After the parameters are loaded (checkpoint.load_model_state): the host masters are copied from them."""
        for piece in self.stepped:
            if piece.key in state:
                optimizer.state[piece.tensor] = state[piece.key]
        for name, p in self.local:
            prefix = f"state.{name}."
            if fields := {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}:
                optimizer.state[p] = fields
        if self.host is not None:
            self.host.pull()

    def before_step(self) -> None:
        """Under offload: the clipped gradients to the host, where the step runs."""
        if self.host is not None:
            self.host.to_host()

    def to_device(self) -> None:
        """Under offload: the updated host shards back to the device, before the all-gather reads them."""
        if self.host is not None:
            self.host.to_device()

    def host_tensors(self) -> list[torch.Tensor] | None:
        if self.host is None:
            return None
        return self.host.tensors()


class Unit:
    """One unit's flat layout: the whole buffer `full` (its parameters are views of it), this rank's shard and its
    pieces; under UnitSync also the shard's averaged gradient and `flat_grad`, the full gradient of the current
    backward until reduced. With `separate_shard` (fsdp) the shard has storage of its own and `full`'s storage is
    given back (resized to 0 bytes) at once, until gathered; otherwise (ZeRO-1, ZeRO-2) the shard is a view of
    `full`, which stays.

    `initial` (fsdp's deferred initialisation): the parameters are on the meta device and only this rank's pieces
    are materialised, one parameter at a time, so no rank ever holds the whole model."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], world_size: int, rank: int, device: torch.device,
                 separate_shard: bool, initial: InitialValue | None = None):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shard_size = -(-sum(p.numel() for p in self.params) // world_size)
        dtype = torch.float32 if initial is not None else self.params[0].dtype
        self.full = torch.zeros(self.shard_size * world_size, dtype=dtype, device=device)
        self.nbytes = self.full.untyped_storage().nbytes()
        lo = rank * self.shard_size
        self.shard = (torch.zeros(self.shard_size, dtype=dtype, device=device) if separate_shard
                      else self.full[lo:lo + self.shard_size])
        self.pieces = shard_pieces(named, lo, self.shard)
        with torch.no_grad():
            for p, region in zip(self.params, self._regions(self.full), strict=True):
                shape = p.shape
                if initial is None:
                    region.copy_(p.detach().reshape(-1))
                else:  # a meta tensor cannot take real data: give the Parameter object a real (empty) tensor first
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, device=device), p.requires_grad))
                # .data, not a view Parameter: the all-gathers into `full` must not bump the version autograd checks
                p.data = region.view(shape)
            if separate_shard and initial is None:
                self.shard.copy_(self.full[lo:lo + self.shard_size])
            if initial is not None:
                for piece in self.pieces:  # one parameter whole at a time, never the unit
                    piece.tensor.copy_(initial(piece.name, piece.param.shape).reshape(-1)[piece.start:piece.end])
        self.gathered = not separate_shard
        if separate_shard:  # freed at once: never two units whole before the first use
            self.full.untyped_storage().resize_(0)
        self.work: Gather | None = None  # an all-gather in progress (fsdp)
        self.grad_shard: torch.Tensor | None = None  # set by UnitSync
        self.flat_grad: torch.Tensor | None = None
        self.grads_in = 0  # parameters whose gradient has arrived in this backward

    def _regions(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        offset = 0
        for p in self.params:
            yield flat[offset:offset + p.numel()]
            offset += p.numel()

    def grad_views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        for p, region in zip(self.params, self._regions(flat), strict=True):
            yield p, region.view(p.shape)


class UnitSync(ShardedOptimizer, GradSync):
    """Gradients reduce-scattered per unit as backward completes them (see the module doc). Subclasses set
    `units` (in any order) and may free a unit once its gradients are taken (`_release`)."""

    units: list[Unit]

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, wire: torch.dtype | None = None,
                 quant_block: int = 0):
        GradSync.__init__(self, model)
        self.group, self.world_size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.wire, self.quant_block = wire, quant_block  # parallel.grad_comm (base.WIRE_DTYPES), parallel.quant_block
        self._inflight = self._peak = 0  # bytes of gathered parameters and flat gradients right now, and the most
        # The outstanding reduce-scatter: its unit, input (the flat gradient), output and work.
        self._pending: tuple[Unit, torch.Tensor, torch.Tensor, dist.Work | QuantisedReduceScatter] | None = None

    def _hook_units(self) -> None:
        """Give every unit its gradient shard (each piece's gradient a view of it) and the gradient hooks."""
        self.pieces = [piece for u in self.units for piece in u.pieces]
        for u in self.units:
            u.grad_shard = torch.zeros_like(u.shard)
            for piece in u.pieces:
                piece.tensor.grad = u.grad_shard[piece.at:piece.at + piece.end - piece.start]
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._grad_ready(u))

    def _account(self, nbytes: int) -> None:
        self._inflight += nbytes
        self._peak = max(self._peak, self._inflight)

    def _new_flat_grad(self, u: Unit) -> None:
        """A zeroed flat gradient for the unit, its parameters' .grad pointing into it, so that backward
        accumulates straight into what the reduce-scatter sends."""
        if u.flat_grad is not None:
            return
        u.flat_grad = torch.zeros_like(u.full)
        self._account(u.nbytes)
        for p, view in u.grad_views(u.flat_grad):
            if p.grad is not None:  # arrived before the buffer existed
                view.copy_(p.grad)
            p.grad = view

    def _grad_ready(self, u: Unit) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._new_flat_grad(u)
            u.grads_in += 1
            if u.grads_in == len(u.params):
                self._reduce_scatter(u)
        return hook

    def _reduce_scatter(self, u: Unit) -> None:
        """Average the unit's gradient into every rank's shard, asynchronously, after the previous one is done."""
        self._drain()
        self._new_flat_grad(u)
        flat = u.flat_grad
        for p in u.params:
            p.grad = None
        flat.div_(self.world_size)
        # The flat gradient is held until the reduce-scatter is waited for, so that its bytes are in flight exactly as
        # long as `_account` counts them on every backend: NCCL keeps a collective's input alive to the end anyway,
        # gloo reduces a copy and would let it go at once.
        if self.wire == torch.int8:
            out = torch.empty_like(u.grad_shard)
            work: dist.Work | QuantisedReduceScatter = QuantisedReduceScatter(flat, out, self.group, self.quant_block)
        else:  # fp32, or cast to bf16 / fp16 for the wire and summed in it, as the replicated syncs do
            sent = flat if self.wire is None else flat.to(self.wire)
            out = torch.empty(u.grad_shard.shape, dtype=sent.dtype, device=sent.device)
            work = reduce_scatter(out, sent, group=self.group, async_op=True)
            count_sent("reduce_scatter", sent.numel() * sent.element_size(), self.group)
        self._pending = (u, flat, out, work)
        u.flat_grad, u.grads_in = None, 0
        self._release(u)

    def _release(self, u: Unit) -> None:
        """After the unit's gradients are taken (fsdp frees its parameters here)."""

    def _drain(self) -> None:
        """Wait for the outstanding reduce-scatter and add its result (fp32, or the wire's type) into its unit's
        gradient shard."""
        if self._pending is None:
            return
        u, _, out, work = self._pending
        start = time.perf_counter()
        with comm_span("reduce_scatter", phase="wait", group=self.group):
            work.wait()
        self.comm_wait_s += time.perf_counter() - start
        u.grad_shard.add_(out)
        self._pending = None
        self._account(-u.nbytes)  # its flat gradient is gone

    def finish(self) -> None:
        """Reduce what backward left (a unit some of whose parameters got no gradient) and wait for it all."""
        for u in self.units:
            if u.grads_in or u.flat_grad is not None:
                self._reduce_scatter(u)
        self._drain()

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard.zero_()

    def clip_targets(self) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
        return [piece.tensor for piece in self.pieces] + [p for _, p in self.local], self.group
