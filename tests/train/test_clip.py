"""The grouped clip (pipeline stages, shards, our tensor-parallel pieces): each of two ranks holds part of the
gradients and both hold one tensor, counted once, and the norm and the clipped gradients are torch's clip of all of
them in one process: on two ranks as threads of the test process (fast), and on the shared gloo pool's processes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gloo_pool import GlooPools
from thread_ranks import run_threads
from torch import nn

from gptpar.parallel.process_group import RankInfo
from gptpar.train.optim import clip_gradients

# inf only measures; 1.0 is below the norm (scaled down); 1e4 is above it, where the gradients are left as they are
MAX_NORMS = (math.inf, 1.0, 1e4)


def _parameters(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return params


def _worker(info: RankInfo) -> None:
    _check(info.rank)


def _check(rank: int) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * scale for n, scale in ((1000, 1.0), (37, 30.0), (4096, 0.1), (5, 3.0))]
    shared = torch.randn(300, generator=gen)
    for max_norm in MAX_NORMS:
        whole = _parameters([*grads, shared])
        expected = float(torch.nn.utils.clip_grad_norm_(whole, max_norm))
        mine = _parameters([*grads[rank::2], shared])  # rank 0 holds tensors 0 and 2, rank 1 tensors 1 and 3
        counted = mine if rank == 0 else mine[:-1]  # the shared tensor counted once
        norm = float(clip_gradients(mine, max_norm, [dist.group.WORLD], counted))
        assert norm == pytest.approx(expected, rel=1e-6)
        for p, ref in zip(mine, [*whole[rank:4:2], whole[4]], strict=True):
            torch.testing.assert_close(p.grad, ref.grad, rtol=1e-6, atol=1e-7)


def test_the_grouped_clip_on_thread_ranks_is_one_process_clip() -> None:
    run_threads(2, _check)


@pytest.mark.slow  # ranks of the shared gloo pool
def test_the_grouped_clip_is_one_process_clip(gloo_pool: GlooPools) -> None:
    gloo_pool.run(2, _worker)
