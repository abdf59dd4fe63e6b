"""Who am I: one object per rank, built once from the environment (through the joined process group) and the
config, that every parallelism asks: the launcher's layout, the backend and device, the grid's sizes, this rank's
coordinates, and its process group (on torch's DeviceMesh) along each dimension. Data shards follow the `dp`
coordinate, gradients are averaged in the `dp` group; nothing asks the global rank what it should do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gptpar.errors import GptparError
from gptpar.parallel.grid import GRID_DIMS, coordinates, group_ranks
from gptpar.parallel.process_group import RankInfo


@dataclass(frozen=True)
class ParallelDims(RankInfo):
    """A joined rank (RankInfo) placed on the grid, with a DeviceMesh (and its sub-groups) when it has peers."""

    sizes: dict[str, int] = field(default_factory=dict)
    coords: dict[str, int] = field(default_factory=dict)
    mesh: DeviceMesh | None = None

    @classmethod
    def build(cls, info: RankInfo, sizes: dict[str, int]) -> ParallelDims:
        """Place `info` on the grid of `sizes` (GRID_DIMS; a missing dimension has size 1)."""
        unknown = set(sizes) - set(GRID_DIMS)
        if unknown:
            raise GptparError(f"rank grid: unknown dimension(s) {', '.join(sorted(unknown))}; "
                              f"dimensions: {', '.join(GRID_DIMS)}")
        full = {dim: int(sizes.get(dim, 1)) for dim in GRID_DIMS}
        ranks = math.prod(full.values())
        if ranks != info.world_size:
            shape = " x ".join(f"{dim}={n}" for dim, n in full.items())
            raise GptparError(f"rank grid {shape} needs {ranks} ranks but the job has {info.world_size}")
        mesh = (init_device_mesh(info.device.type, tuple(full.values()), mesh_dim_names=GRID_DIMS)
                if info.world_size > 1 else None)
        return cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(RankInfo)}, sizes=full,
                   coords=coordinates(info.rank, full), mesh=mesh)

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of the ranks that differ from this one only along `dim` (None alone)."""
        return self.mesh.get_group(dim) if self.mesh is not None and self.sizes[dim] > 1 else None

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in coordinate order."""
        return group_ranks(self.rank, self.sizes, dim)
