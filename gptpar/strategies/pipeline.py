"""The pipeline's own keys: the one-process modes (parallel.pp_mode, chunks, devices) and the multi-process
engine (parallel.pp > 1: its schedule's shape from the schedule table, the batch and the model's depth)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from gptpar.errors import ConfigError, GptparError
from gptpar.strategies.schedules import make_plan

if TYPE_CHECKING:
    from gptpar.config import Config, ParallelConfig


def pp_split_counts(pcfg: ParallelConfig) -> list[int] | None:
    """`parallel.pp_split` as blocks per stage, or None when the split is balanced automatically."""
    if not pcfg.pp_split.strip():
        return None
    try:
        counts = [int(word) for word in pcfg.pp_split.split(",")]
    except ValueError:
        counts = []
    stages = pcfg.pp * pcfg.pp_virtual
    if len(counts) != stages or min(counts) < 1:
        raise ConfigError(f"parallel.pp_split={pcfg.pp_split!r} must list {stages} positive block counts "
                          f"(parallel.pp * parallel.pp_virtual), e.g. {','.join(['1'] * stages)}")
    return counts


def stage_sizes(weights: list[int], n_stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Contiguous blocks per stage (at least one each) minimising the heaviest stage's load.

    `first` and `last` are fixed loads of the first and last stage (embeddings, head).
    Among equally good cuts, earlier stages get more blocks: the last stage carries the LM head.
    """
    n_blocks = len(weights)
    prefix = [0, *itertools.accumulate(weights)]
    inf = float("inf")
    # best[s][k]: lowest possible heaviest load when the first s stages hold the first k blocks.
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        fixed = (first if s == 1 else 0) + (last if s == n_stages else 0)
        for k in range(s, n_blocks - (n_stages - s) + 1):
            for a in range(k - 1, s - 2, -1):
                load = max(best[s - 1][a], prefix[k] - prefix[a] + fixed)
                if load < best[s][k]:
                    best[s][k], cut[s][k] = load, a
    sizes, k = [], n_blocks
    for s in range(n_stages, 0, -1):
        sizes.append(k - cut[s][k])
        k = cut[s][k]
    return sizes[::-1]


def even_sizes(n_blocks: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_blocks, n_stages)
    return [base + (i < extra) for i in range(n_stages)]


def _check_one_process(cfg: Config) -> None:
    """The one-process modes (parallel.pp = 1) drive every stage from one rank."""
    t, p = cfg.train, cfg.parallel
    if p.pp_mode == "pipeline_parallel" and p.chunks > t.batch_size // (p.dp * t.grad_accum):
        raise ConfigError(
            f"parallel.chunks={p.chunks} exceeds the per-rank micro-batch of "
            f"{t.batch_size // (p.dp * t.grad_accum)} sequences")
    if p.pp_mode != "single" and p.dp > 1:
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} drives its stages from one process and cannot be "
                          f"combined with parallel.dp={p.dp} yet; use parallel.dp=1 or parallel.pp_mode=single")
    if p.pp_mode == "single" and p.devices.strip() and p.dp > 1:
        raise ConfigError(f"parallel.devices={p.devices!r} places the stages of one process; with parallel.dp="
                          f"{p.dp} each rank uses its own device: leave parallel.devices empty")


def check(cfg: Config) -> None:
    """The one-process modes, then the multi-process pipeline against them, the schedule's shape, the batch and
    the model's depth."""
    _check_one_process(cfg)
    t, p = cfg.train, cfg.parallel
    if p.pp == 1:
        for key, value, default in (("pp_virtual", p.pp_virtual, 1), ("pp_split", p.pp_split.strip(), "")):
            if value != default:
                raise ConfigError(f"parallel.{key}={value} applies to the multi-process pipeline only; set "
                                  "parallel.pp > 1 or leave it out")
        return
    if p.pp_mode != "single":
        raise ConfigError(f"parallel.pp={p.pp} runs each stage as its own rank; parallel.pp_mode={p.pp_mode} "
                          "drives stages from one process: use one of them (parallel.pp_mode=single with pp > 1)")
    if p.devices.strip():
        raise ConfigError(f"parallel.devices={p.devices!r} places stages inside one process; with parallel.pp="
                          f"{p.pp} each stage rank uses its own device: leave parallel.devices empty")
    replica_batch = t.batch_size // (p.dp * t.grad_accum)
    if replica_batch % p.chunks:
        raise ConfigError(f"train.batch_size={t.batch_size} gives {replica_batch} sequences per replica and "
                          f"micro-step (batch_size / (dp * grad_accum)), which do not divide into parallel.chunks="
                          f"{p.chunks} micro-batches; use a train.batch_size that is a multiple of "
                          f"{p.dp * t.grad_accum * p.chunks}")
    try:
        make_plan(p.pp_schedule, p.pp, p.chunks, p.pp_virtual)
    except GptparError as exc:
        raise ConfigError(str(exc)) from None
    counts = pp_split_counts(p)
    n_layer = cfg.model.shape().n_layer
    stages = p.pp * p.pp_virtual
    if stages > n_layer:
        raise ConfigError(f"parallel.pp * parallel.pp_virtual = {stages} stages but the model has {n_layer} blocks; "
                          "every stage needs at least one block")
    if counts is not None and sum(counts) != n_layer:
        raise ConfigError(f"parallel.pp_split={p.pp_split!r} places {sum(counts)} blocks but the model has "
                          f"{n_layer}")
