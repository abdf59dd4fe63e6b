"""PyTorch's FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the group.

The reference for fully sharded data parallelism: each transformer block is a unit and the root unit keeps the
embeddings, the final norm and the tied LM head together, so one all-gather serves both uses of the tied
matrix. Every parameter becomes a DTensor sharded on dim 0 (padded to a multiple of the group size);
forward and backward gather each unit's parameters just in time and backward reduce-scatters its
gradients, averaged over the group. The optimizer steps the local shards. For N parameters and world
size W this holds about 16N/W bytes per rank, plus what it holds unsharded during a step: 2 root and 4 block units
(over a group of one 2 + 3), and under gradient accumulation every unit's whole gradient between micro-steps
(torch keeps them unsharded until the last micro-step reduce-scatters them): the strategy row's `in_flight`.
parallel.grad_comm=bf16 or fp16 is torch's own `MixedPrecisionPolicy(reduce_dtype=...)`: the gradients
reduce-scattered in that type.

Under parallel.ep each rank's expert slices are `ignored_params`: plain tensors, left whole on their ranks and to
gptpar.parallel.expert_parallel; the global norm then sums every rank's local gradients over the group (the expert
slices counted once, by the trainer).

parallel.offload=params is torch's `CPUOffloadPolicy`: the sharded parameters, their gradients and AdamW's state live
on the host (16N/W bytes there, none on the device between steps), each unit's shard copied to the device for its
all-gather and each reduced gradient shard back, and the optimizer steps on the host. Its host memory is pinned beside
a CUDA device (asynchronous copies) and not on a CPU-only torch, which has no pinned memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import PreTrainedModel

from gptpar.models import architecture
from gptpar.parallel.data_parallel.base import WIRE_DTYPES, GradSync, SyncSetup, broadcast_state


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (whole or tensor-parallel) inside whatever wraps the model."""
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return list(architecture(inner).blocks(inner)) if inner is not None else []


class FSDP2Sync(GradSync):
    name = "fsdp2"

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.group, setup.mesh, setup.local, WIRE_DTYPES[setup.pcfg.grad_comm],
                   setup.pcfg.offload == "params")

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, mesh: DeviceMesh | None = None,
                 local: frozenset[str] = frozenset(), wire: torch.dtype | None = None, offload: bool = False):
        super().__init__(model)
        broadcast_state(model, group, local)  # replicas start equal; the shards are then cut from the same model
        if mesh is None:
            mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
        ignored = {p for name, p in model.named_parameters() if name in local}
        policy = MixedPrecisionPolicy(reduce_dtype=wire)  # parallel.grad_comm: the reduce-scatter's type
        self.offload = offload
        # parallel.offload=params; pinned host memory exists only beside a CUDA device (a CPU-only torch refuses it)
        moved = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, ignored_params=ignored & set(block.parameters()) or None, mp_policy=policy,
                        offload_policy=moved)
        fully_shard(model, mesh=mesh, ignored_params=ignored or None, mp_policy=policy, offload_policy=moved)
        self.norm_group = group if local else None  # see clip_targets
        self.comm_wait_s = None  # the collectives run inside forward and backward

    def host_tensors(self) -> list[torch.Tensor] | None:
        """Under offload every sharded parameter (its gradient and AdamW's state with it)."""
        return list(self.model.parameters()) if self.offload else None

    def clip_targets(self) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
        """Torch's DTensor norm, or with expert slices beside the shards every local gradient over the group."""
        targets, _ = super().clip_targets()
        return targets, self.norm_group

    @contextlib.contextmanager
    def accumulating(self, is_last_micro_step: bool) -> Iterator[None]:
        """Earlier micro-steps accumulate unsharded gradients; the last one reduce-scatters them."""
        self.model.set_requires_gradient_sync(is_last_micro_step)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
