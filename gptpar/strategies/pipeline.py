"""How the multi-process pipeline cuts the model into stages: parallel.pp_split read as blocks per stage, or the
balanced cut. The pipeline keys' checks are the config's (gptpar/config/parallel_checks.py)."""

from __future__ import annotations

import itertools

from gptpar.errors import ConfigError


def pp_split_counts(pp_split: str, stages: int) -> list[int] | None:
    """`parallel.pp_split` as blocks per stage (of parallel.pp * parallel.pp_virtual `stages`), or None when the split
    is balanced automatically."""
    if not pp_split.strip():
        return None
    try:
        counts = [int(word) for word in pp_split.split(",")]
    except ValueError:
        counts = []
    if len(counts) != stages or min(counts) < 1:
        raise ConfigError(f"parallel.pp_split={pp_split!r} must list {stages} positive block counts "
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
