"""The rank grid as arithmetic, torch-free so the login side shapes jobs with it: the named dimensions (pp, dp,
tp), their sizes from a config, a rank's coordinates and the members of its group along a dimension, and the one
rule that fills parallel.dp from a launched rank count.

Ranks are laid out row-major over GRID_DIMS (pp slowest, tp fastest), so a tensor-parallel group is a run of
consecutive ranks: with one task per GPU and tasks filled node by node, it stays on one node, the fastest link.
A new dimension (experts, context) is one more name here and one more size in `grid_sizes`.
"""

from __future__ import annotations

import math

from gptpar.config import Config, updated
from gptpar.errors import ConfigError

GRID_DIMS = ("pp", "dp", "tp")


def grid_sizes(cfg: Config) -> dict[str, int]:
    """Size of each grid dimension; every launcher and log follows this one function."""
    return {"pp": cfg.parallel.pp, "dp": cfg.parallel.dp, "tp": cfg.parallel.tp}


def world_size(cfg: Config) -> int:
    """Ranks (processes, one per GPU on a cluster) the config needs: the product of the grid sizes."""
    return math.prod(grid_sizes(cfg).values())


def ranks_per_replica(cfg: Config) -> int:
    """Ranks of one model replica: the grid's dimensions other than dp."""
    return world_size(cfg) // cfg.parallel.dp


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Row-major coordinates of `rank` in a grid of `sizes` (GRID_DIMS order)."""
    coords = {}
    for dim in reversed(GRID_DIMS):
        rank, coords[dim] = divmod(rank, sizes[dim])
    return {dim: coords[dim] for dim in GRID_DIMS}


def group_ranks(rank: int, sizes: dict[str, int], dim: str) -> list[int]:
    """Global ranks of `rank`'s group along `dim` (those differing from it only there), in coordinate order."""
    stride = math.prod(sizes[d] for d in GRID_DIMS[GRID_DIMS.index(dim) + 1:])
    base = rank - coordinates(rank, sizes)[dim] * stride
    return [base + i * stride for i in range(sizes[dim])]


def launched_config(cfg: Config, launched: int) -> Config:
    """A rank's check of its config against the rank count its launcher started (srun, torchrun): they must
    agree, except that a config asking for one replica takes as many as the launcher started (`srun gptpar
    train` with N tasks trains with dp=N, as the submit side's job shape does); any other mismatch is one line."""
    if launched == world_size(cfg):
        return cfg
    other = ranks_per_replica(cfg)
    if cfg.parallel.dp != 1 or launched % other:
        shape = " x ".join(f"parallel.{d}={n}" for d, n in grid_sizes(cfg).items() if n > 1 or d == "dp")
        raise ConfigError(f"the config asks for {world_size(cfg)} ranks ({shape}) but the "
                          f"launcher started {launched}; set parallel.dp={launched // other or 1} or launch "
                          f"{world_size(cfg)} tasks")
    return updated(cfg, {"parallel.dp": launched // other})
