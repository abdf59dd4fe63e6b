"""The shared pool of gloo ranks the equality tests run on: a task runs on every rank with the caller's environment,
and a failure names its rank and leaves a working pool behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import MAX_GROUPS, GlooPools

from gptpar.errors import GptparError
from gptpar.parallel.process_group import RankInfo


def _sum_of_ranks(info: RankInfo, out: Path) -> None:
    total = torch.tensor(float(info.rank))
    dist.all_reduce(total)
    (out / f"rank{info.rank}").write_text(f"{total.item():g} {os.environ['GPTPAR_POOL_PROBE']} {Path.cwd()}")


def _raise_on_rank_one(info: RankInfo) -> None:
    if info.rank == 1:
        raise ValueError("a bad batch")
    dist.barrier()  # rank 0 waits for a peer that never comes: the pool must not wait with it


@pytest.mark.slow
def test_a_task_runs_on_every_rank_and_a_failure_names_its_rank(gloo_pool: GlooPools, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GptparError, match=r"^rank 1 failed: ValueError: a bad batch "
                       r"\[at tests/test_gloo_pool.py:\d+ \(_raise_on_rank_one\)\]$"):
        gloo_pool.run(2, _raise_on_rank_one)
    monkeypatch.setenv("GPTPAR_POOL_PROBE", "this test's")
    monkeypatch.chdir(tmp_path)
    gloo_pool.run(2, _sum_of_ranks, tmp_path)  # a fresh pool, with this test's environment and folder
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [f"1 this test's {tmp_path}"] * 2


def _make_groups(info: RankInfo, count: int, out: Path) -> None:
    for _ in range(count):
        dist.new_group([0, 1])
    (out / f"pid{info.rank}").write_text(str(os.getpid()))


@pytest.mark.slow
def test_a_pool_whose_ranks_hold_too_many_groups_starts_afresh(gloo_pool: GlooPools, tmp_path: Path) -> None:
    """Each group keeps gloo threads that poll: a pool rank holding more than MAX_GROUPS is replaced, one holding a
    few is kept."""
    pids = []
    for count in (1, MAX_GROUPS, 1):
        gloo_pool.run(2, _make_groups, count, tmp_path)
        pids.append([(tmp_path / f"pid{r}").read_text() for r in (0, 1)])
    assert pids[0] == pids[1] != pids[2]
