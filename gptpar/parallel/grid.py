"""The rank grid: every rank's coordinates along the named dimensions (pp, dp, tp) and its process
groups along each, on torch's DeviceMesh. Every parallelism asks the grid "who am I", never the
global rank: data shards follow the `dp` coordinate, gradients are averaged in the `dp` group.

Ranks are laid out row-major over GRID_DIMS (pp slowest, tp fastest), so a tensor-parallel group
is a run of consecutive ranks: with one task per GPU and tasks filled node by node, it stays on
one node, the fastest link.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gptpar.config import GRID_DIMS
from gptpar.errors import GptparError


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Row-major coordinates of `rank` in a grid of `sizes` (GRID_DIMS order)."""
    coords = {}
    for dim in reversed(GRID_DIMS):
        rank, coords[dim] = divmod(rank, sizes[dim])
    return {dim: coords[dim] for dim in GRID_DIMS}


class RankGrid:
    """This rank's place in the grid, with a DeviceMesh (and its sub-groups) when there are peers."""

    def __init__(self, sizes: dict[str, int], rank: int, world_size: int, device_type: str):
        unknown = set(sizes) - set(GRID_DIMS)
        if unknown:
            raise GptparError(f"rank grid: unknown dimension(s) {', '.join(sorted(unknown))}; "
                              f"dimensions: {', '.join(GRID_DIMS)}")
        self.sizes = {dim: int(sizes.get(dim, 1)) for dim in GRID_DIMS}
        shape = " x ".join(f"{dim}={n}" for dim, n in self.sizes.items())
        if math.prod(self.sizes.values()) != world_size:
            raise GptparError(f"rank grid {shape} needs {math.prod(self.sizes.values())} ranks but the job has "
                              f"{world_size}")
        self.rank, self.world_size = rank, world_size
        self.coords = coordinates(rank, self.sizes)
        self.mesh: DeviceMesh | None = None
        if world_size > 1:
            self.mesh = init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=GRID_DIMS)

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of the ranks that differ from this one only along `dim` (None alone)."""
        return self.mesh.get_group(dim) if self.mesh is not None and self.sizes[dim] > 1 else None

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in coordinate order."""
        stride = math.prod(self.sizes[d] for d in GRID_DIMS[GRID_DIMS.index(dim) + 1:])
        base = self.rank - self.coords[dim] * stride
        return [base + i * stride for i in range(self.sizes[dim])]
