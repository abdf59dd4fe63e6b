"""What torch's fully_shard (FSDP2) holds unsharded at once during real steps, counted in units as the fsdp2 row's
`Pricing.in_flight` counts them (a unit: the root's parameters, or one block's, at 4 bytes a parameter).

Read from FSDP2's own state at every unit's forward (before and after fully_shard's hooks), between a unit's
all-gather and its copy-out, at every gradient of a unit's output and of its input (the moment before its
post-backward reduce-scatters the unit's gradients, all accumulated by then): per parameter group,
its unsharded parameters (`all_gather_outputs`, 0 bytes while resharded) and its unsharded gradients
(`_unsharded_param.grad`, or `unsharded_accumulated_grad` in the reduce type); its pending all-gather output (a
backward prefetch's `_all_gather_result`); per communication context, the all-gather output forward keeps to free at
the next unit's copy-out (`all_gather_state`) and the reduce-scatter inputs kept until the next unit's reduce
(`reduce_scatter_states`), each one unit of its group's kind (root or block), told apart by its size. What autograd
holds before a gradient lands is not seen: the tied matrix's gradient from the head's backward on (its two uses are
summed before they land) counts as a root unit once the final norm's gradient has landed, and its bytes not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from gptpar.strategies.data_parallel import DP_STRATEGIES

Units = tuple[int, int]  # (root units, block units)


class UnshardedUnits:
    """The units a model under fully_shard held unsharded at once: `peak` at the sample of the most bytes, and `most`
    of each kind at any sample; `sizes` (elements of the root unit, of a block, blocks) to price them by."""

    def __init__(self, model: nn.Module) -> None:
        fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root first
        self.groups = [(m is fsdp[0], g) for m in fsdp if (g := m._get_fsdp_state()._fsdp_param_group) is not None]
        # elements of each unit's whole padded buffer (its shards' over the group), the root's first
        whole = [sum(p._sharded_param_data.numel() for p in g.fsdp_params) * g.mesh_info.shard_mesh_size
                 for _, g in self.groups]
        self.is_root = {n: root for n, (root, _) in zip(whole, self.groups, strict=True)}  # tells buffers apart
        self.sizes = (whole[0], whole[1], len(whole) - 1)
        self.peak: Units = (0, 0)
        self.most: Units = (0, 0)
        self.peak_bytes = 0
        for _, group in self.groups:
            group.wait_for_unshard = self._sampled(group.wait_for_unshard)
        for module in fsdp:
            module.register_forward_pre_hook(self._before_forward)
            module.register_forward_hook(lambda *_: self.sample(), prepend=True)  # before fully_shard reshards
            module.register_forward_hook(self._after_forward)

    def _sampled(self, method: Callable[[], None]) -> Callable[[], None]:
        def sampled() -> None:
            self.sample()
            method()
        return sampled

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.sample()
        for arg in args:  # its inputs as fully_shard's hook left them: their gradients come just before post-backward
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                arg.register_hook(lambda _: self.sample())

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.sample()
        outputs = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else (output,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _: self.sample())

    def _buffers(self) -> Iterator[tuple[bool, list[torch.Tensor]]]:
        """(is the root's, its tensors) of each unit-sized thing that may be held."""
        for root, group in self.groups:
            yield root, [t for p in group.fsdp_params for t in p.all_gather_outputs]
            unsharded = [p for p in group.fsdp_params if hasattr(p, "_unsharded_param")]
            yield root, [g for p in unsharded for g in (p._unsharded_param.grad, p.unsharded_accumulated_grad)
                         if g is not None]
            if group._all_gather_result is not None:
                yield root, [group._all_gather_result.all_gather_output]
        for ctx in {id(g.comm_ctx): g.comm_ctx for _, g in self.groups}.values():
            kept = [ctx.all_gather_state.all_gather_result.all_gather_output] if ctx.all_gather_state else []
            for tensor in kept + [state.reduce_scatter_input for state in ctx.reduce_scatter_states]:
                yield self.is_root[tensor.numel()], [tensor]

    def sample(self) -> None:
        counts, nbytes, seen = [0, 0], 0, set()
        for root, tensors in self._buffers():
            live = [s for s in (t.untyped_storage() for t in tensors) if s.nbytes() and id(s) not in seen]
            seen.update(id(s) for s in live)
            if live:
                counts[0 if root else 1] += 1
                nbytes += sum(s.nbytes() for s in live)
        self.most = (max(self.most[0], counts[0]), max(self.most[1], counts[1]))
        if nbytes > self.peak_bytes:
            self.peak, self.peak_bytes = (counts[0], counts[1]), nbytes


def priced_units(sizes: tuple[int, int, int], alone: bool, accumulating: bool) -> tuple[Units, Units]:
    """(peak, most) as the fsdp2 row prices them for units of `sizes`: its moment of the most bytes, and the most of
    each kind over its moments, each beside every unit's gradient (a root and every block) where it keeps them whole."""
    pricing = DP_STRATEGIES["fsdp2"].pricing
    root, block, blocks = sizes
    moments = pricing.in_flight_units(alone, accumulating)
    whole = (1, blocks) if pricing.keeps_whole_gradient(alone, accumulating) else (0, 0)
    peak = max(moments, key=lambda m: m[0] * root + m[1] * block)
    most = (max(r for r, _ in moments), max(b for _, b in moments))
    return (peak[0] + whole[0], peak[1] + whole[1]), (most[0] + whole[0], most[1] + whole[1])
