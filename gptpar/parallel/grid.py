"""The rank grid as arithmetic, torch-free so the login side shapes jobs with it: the named dimensions (pp, dp,
cp, tp), their sizes from a config, a rank's coordinates and the members of its group along a dimension, and the one
rule that fills parallel.dp from a launched rank count.

Ranks are laid out row-major over GRID_DIMS (pp slowest, then dp, cp, tp fastest), so a tensor-parallel group is a
run of consecutive ranks: with one task per GPU and tasks filled node by node, it stays on one node, the fastest link.
A new dimension (experts, context) is one more name here and one more size in `grid_sizes`; a group that
combines dimensions (dp x ep, dp x cp: DP_CP) is one more named `Composite`.

Expert parallelism (ep) is a dimension inside dp, not a factor of the world size: the dp coordinate d of a rank
splits into its expert-parallel coordinate d % ep (which experts it holds) and its expert replica d // ep, so a
group of ep neighbouring replicas shares every block's experts and ranks with equal d % ep hold the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gptpar.config import Config, check_expert_grid, updated
from gptpar.errors import ConfigError

GRID_DIMS = ("pp", "dp", "cp", "tp")  # the world's factors
INNER_DIMS = {"ep": "dp"}  # a dimension inside another one, whose size it divides
EXPERT_REPLICAS = "ep_replicas"  # the group of the ranks that hold the same experts (equal ep coordinate)


def grid_sizes(cfg: Config) -> dict[str, int]:
    """Size of each grid dimension (GRID_DIMS, then INNER_DIMS); every launcher and log follows this one function."""
    p = cfg.parallel
    return {"pp": p.pp, "dp": p.dp, "cp": p.cp, "tp": p.tp, "ep": p.ep}


def world_size(cfg: Config) -> int:
    """Ranks (processes, one per GPU on a cluster) the config needs: the product of the grid's factors."""
    sizes = grid_sizes(cfg)
    return math.prod(sizes.get(dim, 1) for dim in GRID_DIMS)


def ranks_per_replica(cfg: Config) -> int:
    """Ranks of one model replica: the grid's dimensions other than dp."""
    return world_size(cfg) // cfg.parallel.dp


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Row-major coordinates of `rank` in a grid of `sizes` (GRID_DIMS order), then its INNER_DIMS coordinates."""
    coords = {}
    for dim in reversed(GRID_DIMS):
        rank, coords[dim] = divmod(rank, sizes.get(dim, 1))
    inner = {dim: coords[outer] % sizes.get(dim, 1) for dim, outer in INNER_DIMS.items()}
    return {dim: coords[dim] for dim in GRID_DIMS} | inner


def group_ranks(rank: int, sizes: dict[str, int], dim: str) -> list[int]:
    """Global ranks of `rank`'s group along `dim` (those differing from it only there), in coordinate order; for a
    named composite (COMPOSITES: ep, EXPERT_REPLICAS) its members."""
    if dim in COMPOSITES:
        return COMPOSITES[dim].members(rank, sizes)
    stride = math.prod(sizes.get(d, 1) for d in GRID_DIMS[GRID_DIMS.index(dim) + 1:])
    coord = coordinates(rank, sizes)[dim]
    return [rank - coord * stride + i * stride for i in range(sizes.get(dim, 1))]


@dataclass(frozen=True)
class Composite:
    """A named group that is not one grid axis (torchtitan's `dp_cp`, `dp_shard_cp`): its members for a rank (a pure
    function of the grid), made only where every dimension of `needs` is larger than 1. A new dimension adds a name
    and its groups here; every caller asks ParallelDims.group(name)."""

    needs: tuple[str, ...]
    members: Callable[[int, dict[str, int]], list[int]]


def _expert_group(rank: int, sizes: dict[str, int]) -> list[int]:
    """The ep neighbouring replicas that share every block's experts: a block of ep along dp."""
    return block_ranks(rank, sizes, "dp", sizes["ep"])


def _expert_replicas(rank: int, sizes: dict[str, int]) -> list[int]:
    """The replicas that hold the same experts: equal ep coordinate (dp % ep), every ep-th along dp, and every cp
    coordinate (each cp rank runs the experts on its shard of the rows)."""
    stride = math.prod(sizes.get(d, 1) for d in GRID_DIMS[GRID_DIMS.index("dp") + 1:])
    coord, ep = coordinates(rank, sizes)["dp"], sizes["ep"]
    return [member for i in range(sizes["dp"] // ep)
            for member in group_ranks(rank + (coord % ep + i * ep - coord) * stride, sizes, "cp")]


def _replicas(rank: int, sizes: dict[str, int]) -> list[int]:
    """The ranks that hold the same model and average its gradients under context parallelism: every dp and cp
    coordinate, the others (pp, tp) equal."""
    return [member for replica in group_ranks(rank, sizes, "dp") for member in group_ranks(replica, sizes, "cp")]


DP_CP = "dp_cp"  # the data-parallel sync's group under context parallelism (torchtitan's name)
COMPOSITES = {"ep": Composite(("ep",), _expert_group), EXPERT_REPLICAS: Composite(("ep",), _expert_replicas),
              DP_CP: Composite(("cp",), _replicas)}


def composite_groups(sizes: dict[str, int]) -> dict[str, list[list[int]]]:
    """Every group of each named composite the grid of `sizes` makes (ParallelDims makes these, in this order): the
    sorted member lists of all ranks; a composite whose `needs` are not met, or whose groups are single ranks, has
    none."""
    world = math.prod(sizes.get(dim, 1) for dim in GRID_DIMS)
    groups = {}
    for name, composite in COMPOSITES.items():
        if all(sizes.get(dim, 1) > 1 for dim in composite.needs):
            members = every_group(world, lambda r, c=composite: c.members(r, sizes))
            if len(members[0]) > 1:
                groups[name] = members
    return groups


def every_group(world: int, members: Callable[[int], list[int]]) -> list[list[int]]:
    """The distinct groups of `members` over the world's ranks, in one order (torch makes new groups in the same
    order on every rank)."""
    return [list(g) for g in sorted({tuple(members(r)) for r in range(world)})]


def block_ranks(rank: int, sizes: dict[str, int], dim: str, size: int) -> list[int]:
    """Global ranks of `rank`'s block of `size` consecutive coordinates along the grid dimension `dim` (a divisor of
    its size), the other coordinates equal: parallel.ep's group inside dp, and parallel.hpz's node group (with tp
    fastest and tasks filled node by node, consecutive dp coordinates share a node)."""
    stride = math.prod(sizes.get(d, 1) for d in GRID_DIMS[GRID_DIMS.index(dim) + 1:])
    coord = coordinates(rank, sizes)[dim]
    first = coord - coord % size
    return [rank + (first + i - coord) * stride for i in range(size)]


def launched_config(cfg: Config, launched: int) -> Config:
    """A rank's check of its config against the rank count its launcher started (srun, torchrun): they must
    agree, except that a config asking for one replica takes as many as the launcher started (`srun gptpar
    train` with N tasks trains with dp=N, as the submit side's job shape does); any other mismatch is one line."""
    if launched == world_size(cfg):
        check_expert_grid(cfg)
        return cfg
    other = ranks_per_replica(cfg)
    if cfg.parallel.dp != 1 or launched % other:
        sizes = grid_sizes(cfg)
        shape = " x ".join(f"parallel.{d}={sizes.get(d, 1)}" for d in GRID_DIMS if sizes.get(d, 1) > 1 or d == "dp")
        raise ConfigError(f"the config asks for {world_size(cfg)} ranks ({shape}) but the "
                          f"launcher started {launched}; set parallel.dp={launched // other or 1} or launch "
                          f"{world_size(cfg)} tasks")
    return updated(cfg, {"parallel.dp": launched // other})
