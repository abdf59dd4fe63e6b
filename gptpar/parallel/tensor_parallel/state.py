"""What the rest of gptpar needs to know about a tensor-parallel model's pieces, in one place:

- `whole`: a parameter rebuilt whole from the group's pieces (in GPT-2's own layout: q, k, v columns in order,
  the token table as built, padded), for comparisons and exports;
- `as_dtensors` / `as_local`: a checkpoint's state with each piece wrapped as a DTensor sharded over the group's
  mesh, so DCP stores every piece once under its GPT-2 name with the whole shape (the fused q, k, v columns as
  (in, 3, out/3), the vocabulary padded) instead of T different tensors under one key, and back;
- `counts_in_norm`: whether this rank counts a tensor in the global gradient norm (pieces everywhere, replicated
  tensors on the group's first rank only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gptpar.parallel.data_parallel.base import GradSync
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.tensor_parallel.comm import all_gather_dim
from gptpar.parallel.tensor_parallel.layers import TPShard


def shard_of(tensor: torch.Tensor) -> TPShard | None:
    return getattr(tensor, "tp_shard", None)


def whole(param: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole parameter from every rank's piece (a collective over `group`); a replicated one as it is."""
    spec = shard_of(param)
    if spec is None or group is None:
        return param.detach()
    gathered = all_gather_dim(param.detach(), spec.dim, group, counted=False).movedim(spec.dim, 0)
    # (rank, part, n) -> (part, rank, n): each part's slices in rank order.
    per_part = gathered.unflatten(0, (dist.get_world_size(group), spec.parts, -1)).transpose(0, 1).flatten(0, 2)
    return per_part.movedim(0, spec.dim)


def _view(local: torch.Tensor, spec: TPShard) -> tuple[torch.Tensor, int]:
    """The piece viewed so that its shards line up along one dim of the whole tensor's layout."""
    if spec.parts == 1:
        return local, spec.dim
    return local.unflatten(spec.dim, (spec.parts, -1)), spec.dim + 1


def as_dtensors(state: dict[str, Any], shards: dict[str, TPShard], mesh: DeviceMesh) -> dict[str, Any]:
    """`state` with the tensors named in `shards` (exactly, or as `<name>.<optimizer field>`) as DTensors."""
    def wrap(key: str, value: Any) -> Any:
        spec = shards.get(key) or shards.get(key.rpartition(".")[0])
        if spec is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        local, dim = _view(value, spec)
        return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    return {key: wrap(key, value) for key, value in state.items()}


def as_local(state: dict[str, Any], shards: dict[str, TPShard]) -> dict[str, Any]:
    """Inverse of as_dtensors: each DTensor named in `shards` back to this rank's piece in its own layout (others,
    FSDP2's shards beside parallel.ep's experts, stay DTensors)."""
    def unwrap(key: str, value: Any) -> Any:
        spec = shards.get(key) or shards.get(key.rpartition(".")[0])
        if not isinstance(value, DTensor) or spec is None:
            return value
        local = value.to_local()
        return local.flatten(spec.dim, spec.dim + 1) if spec.parts > 1 else local
    return {key: unwrap(key, value) for key, value in state.items()}


def sharded_names(named: dict[str, torch.Tensor]) -> dict[str, TPShard]:
    """The sharded entries of a name -> parameter mapping."""
    return {name: spec for name, p in named.items() if (spec := shard_of(p)) is not None}


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Each piece is counted by its holder; a replicated tensor (the same on every rank) once, on rank 0."""
    return shard_of(param) is not None or tp_rank == 0


def _tagged(state: dict[str, Any], rank: int) -> dict[str, Any]:
    return {f"tp{rank}/{key}": value for key, value in state.items()}


def _untagged(state: dict[str, Any], rank: int) -> dict[str, Any]:
    return {key.removeprefix(f"tp{rank}/"): value for key, value in state.items()}


class CheckpointLayout:
    """How our tensor-parallel pieces are keyed in a checkpoint (see the module docstring). Pieces of whole
    parameters become DTensors under GPT-2's names; the flat shards of a sharding sync (zero1, zero2, fsdp), which
    cut across pieces, are stored per tensor-parallel rank under `tp<r>/<key>`, loadable with the same parallel.tp."""

    def __init__(self, net: nn.Module, sync: GradSync, dims: ParallelDims):
        self.shards = sharded_names(dict(net.named_parameters(remove_duplicate=False)))
        self.optimizer_shards = {f"state.{name}": spec for name, spec in self.shards.items()}
        self.mesh, self.rank = dims.mesh["tp"], dims.coord("tp")
        self.sharded_optimizer, self.sharded_parameters = sync.shards_optimizer, sync.shards_parameters

    def save(self, model: dict[str, Any], optimizer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.sharded_parameters:
            model = {**model, "pieces": _tagged(model["pieces"], self.rank)}
        else:
            model = as_dtensors(model, self.shards, self.mesh)
        if self.sharded_optimizer:
            return model, _tagged(optimizer, self.rank)
        return model, as_dtensors(optimizer, self.optimizer_shards, self.mesh)

    def load(self, model: dict[str, Any], optimizer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.sharded_parameters:
            model = {**model, "pieces": _untagged(model["pieces"], self.rank)}
        else:
            model = as_local(model, self.shards)
        if self.sharded_optimizer:
            return model, _untagged(optimizer, self.rank)
        return model, as_local(optimizer, self.optimizer_shards)
