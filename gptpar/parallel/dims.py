"""Who am I: one object per rank, built once from the environment (through the joined process group) and the
config, that every parallelism asks: the launcher's layout, the backend and device, the grid's sizes, this rank's
coordinates, and its process group (on torch's DeviceMesh) along each dimension. Data shards follow the `dp`
coordinate, gradients are averaged in the `dp` group (`replica_group`: dp x cp under context parallelism); nothing
asks the global rank what it should do. Expert parallelism's groups (`ep`, and EXPERT_REPLICAS: the ranks holding the
same experts) and dp x cp (grid.DP_CP) lie outside the DeviceMesh's axes: named composites (grid.COMPOSITES), made
once here and asked for by name like an axis.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gptpar.errors import GptparError
from gptpar.parallel.flight import name_group
from gptpar.parallel.grid import (
    COMPOSITES,
    DP_CP,
    GRID_DIMS,
    INNER_DIMS,
    block_ranks,
    composite_groups,
    coordinates,
    every_group,
    group_ranks,
)
from gptpar.parallel.process_group import RankInfo, subgroup


@dataclass(frozen=True)
class ParallelDims(RankInfo):
    """A joined rank (RankInfo) placed on the grid, with a DeviceMesh (and its sub-groups) when it joined a process
    group: it has peers, or joined a world of one for a sync that needs a group alone (process_group.needs_group)."""

    sizes: dict[str, int] = field(default_factory=dict)
    coords: dict[str, int] = field(default_factory=dict)
    mesh: DeviceMesh | None = None
    composites: dict[str, dist.ProcessGroup] = field(default_factory=dict)  # grid.COMPOSITES', where made

    @classmethod
    def build(cls, info: RankInfo, sizes: dict[str, int]) -> ParallelDims:
        """Place `info` on the grid of `sizes` (GRID_DIMS, then INNER_DIMS; a missing dimension has size 1)."""
        dims = (*GRID_DIMS, *INNER_DIMS)
        unknown = set(sizes) - set(dims)
        if unknown:
            raise GptparError(f"rank grid: unknown dimension(s) {', '.join(sorted(unknown))}; "
                              f"dimensions: {', '.join(dims)}")
        full = {dim: int(sizes.get(dim, 1)) for dim in dims}
        ranks = math.prod(full[dim] for dim in GRID_DIMS)
        if ranks != info.world_size:
            shape = " x ".join(f"{dim}={full[dim]}" for dim in GRID_DIMS)
            raise GptparError(f"rank grid {shape} needs {ranks} ranks but the job has {info.world_size}")
        for inner, outer in INNER_DIMS.items():
            if full[outer] % full[inner]:
                raise GptparError(f"rank grid: {inner}={full[inner]} does not divide {outer}={full[outer]}")
        mesh = (init_device_mesh(info.device.type, tuple(full[dim] for dim in GRID_DIMS), mesh_dim_names=GRID_DIMS)
                if info.world_size > 1 or dist.is_initialized() else None)
        placed = cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(RankInfo)}, sizes=full,
                     coords=coordinates(info.rank, full), mesh=mesh, composites=_composites(full))
        for dim in (*GRID_DIMS, *COMPOSITES):
            name_group(placed.group(dim), dim)  # the flight recorder's names
        return placed

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def group(self, dim: str, alone: bool = False) -> dist.ProcessGroup | None:
        """The process group of the ranks that differ from this one only along `dim` (None alone, unless `alone` asks
        for the group of one of a joined world: a sync that works without peers, process_group.needs_group); for a
        named composite (grid.COMPOSITES: ep, the ranks that share the experts; EXPERT_REPLICAS, those that hold the
        same ones) its group, None where the grid does not make it."""
        if dim in COMPOSITES:
            return self.composites.get(dim)
        return self.mesh.get_group(dim) if self._has(dim, alone) else None

    def submesh(self, dim: str, alone: bool = False) -> DeviceMesh | None:
        """The DeviceMesh along the grid dimension `dim` (torch's sharding strategies take one); None alone, unless
        `alone` (as for `group`)."""
        return self.mesh[dim] if self._has(dim, alone) else None

    def _has(self, dim: str, alone: bool) -> bool:
        return self.mesh is not None and (self.sizes[dim] > 1 or alone)

    def replica_group(self, alone: bool = False) -> dist.ProcessGroup | None:
        """The group over which gradients are averaged and losses summed: the ranks that hold the same model, dp x cp
        (grid.DP_CP) under context parallelism, else dp (None alone, unless `alone`, as for `group`)."""
        return self.group(DP_CP) if self.sizes["cp"] > 1 else self.group("dp", alone)

    def replica_mesh(self, alone: bool = False) -> DeviceMesh | None:
        """The DeviceMesh of `replica_group` (torch's fully_shard takes one): the grid's dp axis, or under context
        parallelism a one-axis mesh over the dp x cp group (torch's DeviceMesh cuts no composite of two axes from the
        grid without making a group of its own: every rank would have to make it, in order)."""
        if self.sizes["cp"] == 1:
            return self.submesh("dp", alone)
        group = self.group(DP_CP)
        return DeviceMesh.from_group(group, self.device.type) if group is not None else None

    def replicas(self) -> int:
        """The size of `replica_group`: each of its ranks computes an equal share of the step's mean loss."""
        return self.sizes["dp"] * self.sizes["cp"]

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in coordinate order."""
        return group_ranks(self.rank, self.sizes, dim)

    def block_group(self, dim: str, size: int) -> dist.ProcessGroup:
        """This rank's group of `size` consecutive coordinates along `dim` (grid.block_ranks): parallel.hpz's node
        group inside dp. Every rank must ask, in the same order (torch's rule for new groups)."""
        groups = every_group(self.world_size, lambda r: block_ranks(r, self.sizes, dim, size))
        block = subgroup(groups)
        name_group(block, f"{dim}_block")
        return block


def _composites(sizes: dict[str, int]) -> dict[str, dist.ProcessGroup]:
    """This rank's group of each named composite the grid makes (`composite_groups`); every rank makes them all,
    in one order, and keeps its own."""
    return {name: subgroup(groups) for name, groups in composite_groups(sizes).items()}
