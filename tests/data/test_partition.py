"""Data-parallel shards: disjoint, covering, equal, seeded, reshuffled per epoch, order-stable."""

from __future__ import annotations

import pytest
import torch

from gptpar.data.partition import DataPartitioner, Partition, partition_dataset
from gptpar.errors import GptparError
from gptpar.train.trainer import epoch_steps


def shard_ids(rank: int, world: int, n: int, batch: int, seed: int = 1234, epoch: int = 0) -> list[int]:
    loader = partition_dataset(rank, world, list(range(n)), batch, seed=seed, epoch=epoch)
    return [int(i) for b in loader for i in b]


@pytest.mark.parametrize("n, world, batch", [(100, 4, 8), (103, 4, 8), (10, 3, 3), (64, 1, 16)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(n: int, world: int, batch: int) -> None:
    per_rank = batch // world
    steps = n // batch
    indices = [list(partition_dataset(r, world, list(range(n)), batch).dataset.index) for r in range(world)]
    assert all(len(ix) == steps * per_rank for ix in indices)  # n % batch samples dropped this epoch
    flat = [i for ix in indices for i in ix]
    assert len(set(flat)) == len(flat) == n - n % batch
    # every rank runs the same number of steps, each a full per-rank batch
    loaders = [partition_dataset(r, world, list(range(n)), batch) for r in range(world)]
    assert {len(loader) for loader in loaders} == {steps}
    assert all(len(b) == per_rank for loader in loaders for b in loader)


@pytest.mark.parametrize("world", [2, 4])
def test_a_step_across_ranks_is_the_single_process_batch(world: int) -> None:
    """What makes W ranks with global batch B train exactly like one process with batch B."""
    single = [b.tolist() for b in partition_dataset(0, 1, list(range(50)), 8, seed=3, epoch=2)]
    ranks = [[b.tolist() for b in partition_dataset(r, world, list(range(50)), 8, seed=3, epoch=2)]
             for r in range(world)]
    for step, batch in enumerate(single):
        assert [i for r in range(world) for i in ranks[r][step]] == batch


def test_deterministic_and_identical_on_every_rank_for_a_seed() -> None:
    assert shard_ids(1, 4, 200, 8, seed=5) == shard_ids(1, 4, 200, 8, seed=5)
    assert shard_ids(1, 4, 200, 8, seed=5) != shard_ids(1, 4, 200, 8, seed=6)


def test_each_epoch_reshuffles_but_stays_disjoint() -> None:
    e0 = [shard_ids(r, 2, 40, 4, epoch=0) for r in range(2)]
    e1 = [shard_ids(r, 2, 40, 4, epoch=1) for r in range(2)]
    assert e0 != e1
    assert sorted(e1[0] + e1[1]) == list(range(40))
    assert shard_ids(0, 2, 40, 4, seed=10, epoch=1) == shard_ids(0, 2, 40, 4, seed=11, epoch=0)


def test_shard_order_is_fixed_so_resume_can_skip_batches() -> None:
    loader = partition_dataset(1, 2, list(range(50)), 6)
    batches = [b.tolist() for b in loader]
    assert [b.tolist() for b in loader] == batches  # iterating again gives the same order
    assert [i for b in batches for i in b] == loader.dataset.index[:len(batches) * 3]


def test_batch_size_must_divide_by_world_size() -> None:
    with pytest.raises(GptparError, match="train.batch_size=10 does not divide by the 4"):
        partition_dataset(0, 4, list(range(100)), 10)


def test_too_small_dataset_and_bad_rank_are_errors() -> None:
    with pytest.raises(GptparError, match="10 examples, fewer than one global batch of 16"):
        partition_dataset(0, 4, list(range(10)), 16)
    with pytest.raises(GptparError, match="rank 4 is outside 0..3"):
        partition_dataset(4, 4, list(range(100)), 8)


def test_collate_fn_is_used() -> None:
    data = [(torch.tensor([i]), torch.tensor([i + 1])) for i in range(8)]
    loader = partition_dataset(0, 2, data, 4, collate_fn=lambda items: len(items))
    assert list(loader) == [2, 2]


def test_data_partitioner_fractions() -> None:
    data = list(range(9))
    parts = DataPartitioner(data, [1 / 3] * 3, seed=3)
    assert [len(parts.use(i)) for i in range(3)] == [3, 3, 3]
    assert sorted(x for i in range(3) for x in parts.use(i)) == data
    uneven = DataPartitioner(list(range(100)), (0.7, 0.2, 0.1))
    assert [len(uneven.use(i)) for i in range(3)] == [70, 20, 10]
    # 0.29 * 100 is 28.999999999999996 and 0.57 * 100 is 56.99999999999999 in floating point: still 29 and 57
    assert [len(DataPartitioner(list(range(100)), (0.29, 0.57)).use(i)) for i in range(2)] == [29, 57]
    with pytest.raises(GptparError, match="summing to <= 1"):
        DataPartitioner(data, [0.6, 0.6])


def test_partition_views_data_through_index() -> None:
    part = Partition(["a", "b", "c", "d"], [3, 1])
    assert len(part) == 2 and [part[0], part[1]] == ["d", "b"]


def _step_samples(dp: int, accum: int, skip: int, n: int = 37, batch: int = 8, epoch: int = 1) -> list[list[int]]:
    """The sample indices of each step of an epoch, over every rank of `dp`, from step `skip` on, as the trainer cuts
    them (epoch_steps over each rank's partition_dataset of batch // accum)."""
    steps_per_epoch = n // batch
    per_rank = [epoch_steps(partition_dataset(r, dp, list(range(n)), batch // accum, seed=5, epoch=epoch), accum, skip,
                            steps_per_epoch) for r in range(dp)]
    return [sorted(int(i) for step in steps for micro in step for i in micro) for steps in zip(*per_rank, strict=True)]


@pytest.mark.parametrize(("before", "after"), [((2, 1), (1, 1)), ((1, 1), (4, 1)), ((2, 1), (1, 2)), ((4, 2), (2, 1))])
def test_a_run_continued_on_another_layout_sees_the_uninterrupted_runs_samples(before: tuple[int, int],
                                                                               after: tuple[int, int]) -> None:
    """--reshape (issue 51): stopped after step 2 under (dp, grad_accum) `before`, continued under `after`, each step
    of the epoch is the same set of samples as the uninterrupted run's, and the epoch sees every sample once but the
    dropped tail."""
    uninterrupted = _step_samples(*before, skip=0)
    resumed = _step_samples(*before, skip=0)[:2] + _step_samples(*after, skip=2)
    assert resumed == uninterrupted and len(resumed) == 4
    seen = [i for step in resumed for i in step]
    assert len(seen) == len(set(seen)) == 32  # 37 // 8 steps of 8: none twice, five dropped
