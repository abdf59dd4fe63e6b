"""Our fully sharded data parallelism (ZeRO-3): parameters, gradients and optimizer state all sharded over the group.

Units: each GPT-2 block, and a root unit holding everything else (embeddings, final norm, the tied LM head), so
that one gather serves both uses of the tied matrix. Each unit has the flat layout of sharded.py: rank r keeps the
r-th W-th of it (its shard, in storage of its own) and the optimizer steps the pieces of that shard. The unit's
parameters are views of the flat buffer, whose
storage is given back (resized to 0 bytes) while the unit is not in use: the views stay valid, autograd's saved
weights included, and see the data again after the next all-gather.

A step:
- forward: the root unit is gathered first and kept to the end of backward (the LM head and the embedding's
  backward need it). Block i waits for its all-gather (started by block i-1, so it overlaps block i-1's compute),
  starts block i+1's, runs, and is freed.
- backward: when the gradient of block i's output is ready (a tensor hook set in forward), block i is gathered
  again (its all-gather started by block i+1) and block i-1's all-gather starts. Its gradients are reduce-scattered
  as sharded.UnitSync does (overlapped with the next unit's backward), after which the unit is freed; the root's,
  the last of backward, is waited for at once.
- the optimizer updates the shards in place; nothing is gathered after the step, the next forward does it.

Gathers go as parallel.param_comm says (fp32, bf16, or int8: ZeRO++'s qwZ) and, under parallel.hpz, only a unit's
first gather of a step crosses nodes; the rest stay within the node (param_comm.py).

Per rank this holds 16N/W bytes of state (each unit padded to a multiple of W), plus, in flight during backward,
the root unit's parameters and flat gradient (the tied LM head's gradient accumulates from the first backward op
to the last), two blocks' parameters (the one computing, the one prefetched) and two blocks' flat gradients (the
one accumulating, the one being reduce-scattered): 2 root + 4 block units, which `gathered_peak_bytes` records.

Deferred initialisation: given `initial` (the initial value of a parameter, by name), a model built on the meta
device is materialised one parameter at a time, keeping only this rank's part of each (sharded.Unit).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gptpar.parallel.data_parallel.base import WIRE_DTYPES, GradSync, SyncSetup, broadcast_state
from gptpar.parallel.data_parallel.fsdp2 import transformer_blocks
from gptpar.parallel.data_parallel.param_comm import INTRA, Gather, ParamWire, Secondary
from gptpar.parallel.data_parallel.sharded import InitialValue, Unit, UnitSync


class FSDPSync(UnitSync):
    name = "fsdp"
    shards_parameters = True

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.group, setup.device, setup.initial, WIRE_DTYPES[setup.pcfg.grad_comm],
                   setup.pcfg.quant_block, setup.pcfg.param_comm, setup.node_group)

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, device: torch.device,
                 initial: InitialValue | None = None, wire: torch.dtype | None = None, quant_block: int = 0,
                 param_comm: str = "fp32", node_group: dist.ProcessGroup | None = None):
        """`param_comm` is parallel.param_comm; `node_group` this rank's data-parallel ranks on its node under
        parallel.hpz (None: no secondary copy)."""
        super().__init__(model, group, wire, quant_block)
        self.param_wire = ParamWire(param_comm, self.world_size, quant_block)
        self.exact = ParamWire("fp32", self.world_size)  # whole_parameters: the masters as they are
        if initial is None:
            broadcast_state(model, group)  # replicas start equal; the shards are then cut from the same model
        blocks = transformer_blocks(model)
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        names = {id(p): n for n, p in model.named_parameters()}

        def unit(params: list[nn.Parameter]) -> Unit:
            trainable = [(names[id(p)], p) for p in params if p.requires_grad]
            return Unit(trainable, self.world_size, self.rank, device, separate_shard=True, initial=initial)

        self.root = unit([p for p in model.parameters() if id(p) not in in_blocks])
        self.blocks = [unit(list(block.parameters())) for block in blocks]
        self.units = [*reversed(self.blocks), self.root]  # the order backward completes them
        self.secondary = {id(u): Secondary(node_group) for u in self.units} if node_group is not None else {}
        self._hook_units()
        model.register_forward_pre_hook(self._before_root)
        model.register_forward_hook(self._after_root)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._before_block(i))
            block.register_forward_hook(self._after_block(i))

    # -- gathering and freeing --------------------------------------------------------------------------------
    def _start_gather(self, u: Unit, exact: bool = False) -> None:
        """Issue the unit's all-gather: within the node from hpZ's secondary copy where it holds the current
        parameters, else over the group (keeping the node's slice under hpZ); `exact`: the fp32 masters, over the
        group, without touching the copy."""
        if u.gathered:
            return
        u.full.untyped_storage().resize_(u.nbytes)
        self._account(u.nbytes)
        second = None if exact else self.secondary.get(id(u))
        if second is not None and second.valid:
            u.work = Gather(self.param_wire, second.parts, u.full, second.group, INTRA)
        else:
            wire = self.exact if exact else self.param_wire
            u.work = Gather(wire, wire.encode(u.shard), u.full, self.group, keep=second)
        u.gathered = True

    def _gather(self, u: Unit) -> None:
        """The unit's whole parameters, now (waiting for an all-gather already started)."""
        self._start_gather(u)
        if u.work is not None:
            start = time.perf_counter()
            u.work.wait()
            self.comm_wait_s += time.perf_counter() - start
            u.work = None

    def _release(self, u: Unit) -> None:
        if u.gathered:
            if u.work is not None:  # a prefetch nobody used: collectives must complete before their buffer goes
                u.work.wait()
                u.work = None
            u.full.untyped_storage().resize_(0)
            self._account(-u.nbytes)
            u.gathered = False
        if u is self.root:  # the last unit of backward: nothing is left to overlap, and the next micro-step's
            self._drain()  # forward should not carry its flat gradient

    # -- forward and backward hooks ---------------------------------------------------------------------------
    def _before_root(self, module: nn.Module, args: Any) -> None:
        self._gather(self.root)
        if self.blocks:
            self._start_gather(self.blocks[0])

    def _after_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will need the root
            self._release(self.root)
            return
        self._new_flat_grad(self.root)
        if self.blocks:
            self._start_gather(self.blocks[-1])  # backward starts with the last block

    def _before_block(self, i: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._gather(self.blocks[i])
            if i + 1 < len(self.blocks):
                self._start_gather(self.blocks[i + 1])
        return hook

    def _after_block(self, i: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._release(self.blocks[i])
            hidden = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and hidden.requires_grad:
                hidden.register_hook(self._before_block_backward(i))
        return hook

    def _before_block_backward(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._gather(self.blocks[i])
            self._new_flat_grad(self.blocks[i])
            if i > 0:
                self._start_gather(self.blocks[i - 1])
        return hook

    # -- the GradSync interface -------------------------------------------------------------------------------
    def after_step(self) -> None:
        """Nothing to gather: the next forward gathers each unit when it needs it (over the group: hpZ's copies
        hold the parameters from before the step)."""
        for second in self.secondary.values():
            second.valid = False

    def memory_fields(self) -> dict[str, int]:
        seconds = list(self.secondary.values())
        held = {"hpz_bytes": sum(s.nbytes for s in seconds), "hpz_node_size": seconds[0].size} if seconds else {}
        return {"gathered_peak_bytes": self._peak} | held

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[None]:
        """Every unit gathered for the duration (to read or compare the model), freed again after: the fp32 masters
        exactly, whatever parallel.param_comm sends in training."""
        freed = [u for u in self.units if not u.gathered]
        for u in freed:
            self._start_gather(u, exact=True)
            self._gather(u)
        try:
            yield
        finally:
            for u in freed:
                self._release(u)

    def parameter_state(self) -> dict[str, Any]:
        """This rank's pieces of the parameters (keys name parameter and range, as the optimizer state's do) and
        every parameter's shape, so that a one-process export can put the whole tensors back together."""
        return {"pieces": {piece.key: piece.tensor.detach().clone() for piece in self.pieces},
                "shapes": {name: list(p.shape) for u in self.units for name, p in zip(u.names, u.params, strict=True)}}

    def load_parameter_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for piece in self.pieces:
                piece.tensor.copy_(state["pieces"][piece.key])
        self.after_step()  # hpZ's copies hold the parameters from before the load


def join_pieces(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Whole parameters from the pieces of every rank (`parameter_state` merged by a one-process load)."""
    flat: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, value in state["pieces"].items():
        name, _, span = key.rpartition("[")
        flat.setdefault(name, []).append((int(span.split(":")[0]), value))
    return {name: torch.cat([v for _, v in sorted(parts, key=lambda part: part[0])]).view(state["shapes"][name])
            for name, parts in flat.items()}
