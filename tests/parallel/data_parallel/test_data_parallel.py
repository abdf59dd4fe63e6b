"""Gradient sync on real gloo groups: every strategy keeps ranks identical and equals 1-process training.

One spawn per world size runs every strategy with and without gradient accumulation; ranks save
their gradients and parameters to files and the assertions compare the files here.
"""

from __future__ import annotations

import dataclasses
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import GlooPools
from torch import nn
from torch.utils.data import TensorDataset

from gptpar.config import ModelConfig, ParallelConfig
from gptpar.data.partition import partition_dataset
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.data_parallel import GradSync, make_grad_sync
from gptpar.parallel.data_parallel.bucketed import plan_buckets
from gptpar.parallel.process_group import RankInfo

VOCAB, SEQ, STEPS, LR, SEED, GLOBAL_BATCH = 128, 16, 3, 0.1, 7, 8
STRATEGIES = ("naive", "bucketed", "ddp")
BUCKET_MB = 0.02  # ~5k floats: the small model splits into many buckets, exercising the ordering


def small_model() -> nn.Module:
    return build_model(ModelConfig(preset="gpt2-tiny", n_layer=2, n_embd=64, n_head=2), VOCAB, seed=0)


def token_dataset(n: int = 64) -> TensorDataset:
    blocks = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(blocks[:, :-1], blocks[:, 1:])


def rank_batches(rank: int, world: int) -> list[list[torch.Tensor]]:
    loader = partition_dataset(rank, world, token_dataset(), GLOBAL_BATCH, seed=SEED)
    return list(islice(loader, STEPS))


def train(sync: GradSync, batches: list[list[torch.Tensor]], accum: int) -> dict[str, torch.Tensor]:
    """SGD steps as the trainer does them; returns the gradients of the first step."""
    opt = torch.optim.SGD(sync.model.parameters(), lr=LR)
    first: dict[str, torch.Tensor] = {}
    for x, y in batches:
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            with sync.accumulating(is_last_micro_step=i == accum - 1):
                (lm_loss(sync.module(xm).logits, ym) / accum).backward()
        sync.finish()
        first = first or {n: p.grad.clone() for n, p in sync.model.named_parameters()}
        opt.step()
        # sync.zero_grad keeps the bucketed reducer's .grad aliasing its buckets (backward adds in
        # place); optimizer.zero_grad sets them to None and exercises its copy path.
        if accum == 1:
            opt.zero_grad()
        else:
            sync.zero_grad()
    return first


class Branchy(nn.Module):
    """`b` is used only when asked: a parameter that gets no gradient on some ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) if use_b else h).square().sum()


def branchy_grads(rank: int, sync: GradSync | None = None) -> dict[str, torch.Tensor]:
    model = sync.model if sync else Branchy()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x, use_b=rank == 0).backward()
    if sync:
        sync.finish()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def dp_worker(info: RankInfo, out_dir: Path) -> None:
    torch.set_num_threads(1)
    batches = rank_batches(info.rank, info.world_size)
    for strategy in STRATEGIES:
        pcfg = ParallelConfig(dp=info.world_size, dp_sync=strategy, bucket_mb=BUCKET_MB)
        for accum in (1, 2):
            model = small_model()
            grads = train(make_grad_sync(model, pcfg, dist.group.WORLD), batches, accum)
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.save({"grads": grads, "params": params},
                       out_dir / f"{strategy}-accum{accum}-rank{info.rank}.pt")
        if strategy != "ddp":  # DDP needs find_unused_parameters for this; ours must not
            pcfg = dataclasses.replace(pcfg, bucket_mb=1e-5)  # one bucket per parameter
            sync = make_grad_sync(Branchy(), pcfg, dist.group.WORLD)
            torch.save(branchy_grads(info.rank, sync), out_dir / f"{strategy}-unused-rank{info.rank}.pt")
            sync.model.zero_grad(set_to_none=True)  # now the unused parameter's .grad is None
            torch.save(branchy_grads(info.rank, sync), out_dir / f"{strategy}-unused2-rank{info.rank}.pt")
    dist.barrier()


def reference(world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Single-process training on the same global batches (the ranks' batches side by side)."""
    per_rank = [rank_batches(r, world) for r in range(world)]
    global_batches = [[torch.cat([per_rank[r][k][j] for r in range(world)]) for j in range(2)]
                      for k in range(STEPS)]
    model = small_model()
    grads = train(GradSync(model), global_batches, 1)
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools):
    world = request.param
    out = tmp_path_factory.mktemp(f"dp{world}")
    gloo_pool.run(world, dp_worker, out)

    def load(name: str, rank: int = 0) -> dict:
        return torch.load(out / f"{name}-rank{rank}.pt")

    return world, load


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.slow
def test_ranks_end_bitwise_identical(run, strategy: str, accum: int) -> None:
    world, load = run
    first = load(f"{strategy}-accum{accum}")
    for rank in range(1, world):
        other = load(f"{strategy}-accum{accum}", rank)
        assert_same(first["grads"], other["grads"], exact=True)  # the assignment's saved-gradient check
        assert_same(first["params"], other["params"], exact=True)


@pytest.mark.slow
def test_strategies_agree(run) -> None:
    _, load = run
    naive = load("naive-accum1")
    for strategy in ("bucketed", "ddp"):
        assert_same(naive["grads"], load(f"{strategy}-accum1")["grads"], exact=False)
        assert_same(naive["params"], load(f"{strategy}-accum1")["params"], exact=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.slow
def test_dp_equals_single_process_on_the_global_batch(run, strategy: str) -> None:
    world, load = run
    ref = reference(world)
    for accum in (1, 2):  # accumulation over micro-batches must equal the larger batch too
        got = load(f"{strategy}-accum{accum}")
        assert_same(ref["grads"], got["grads"], exact=False)
        assert_same(ref["params"], got["params"], exact=False)
    assert not torch.equal(ref["params"]["transformer.h.0.mlp.c_fc.weight"],
                           small_model().transformer.h[0].mlp.c_fc.weight)  # training moved it


@pytest.mark.parametrize("strategy", ["naive", "bucketed"])
@pytest.mark.slow
def test_parameter_unused_on_some_ranks_still_syncs(run, strategy: str) -> None:
    world, load = run
    local = [branchy_grads(r) for r in range(world)]
    expected = {n: sum(g[n] for g in local) / world for n in local[0]}
    assert torch.count_nonzero(local[1]["b.weight"]) == 0 and torch.count_nonzero(expected["b.weight"]) > 0
    for rank in range(world):
        assert_same(expected, load(f"{strategy}-unused", rank), exact=False)
        assert_same(expected, load(f"{strategy}-unused2", rank), exact=False)


def test_tied_weight_hook_fires_once_per_backward() -> None:
    model = small_model()
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte
    calls = []
    wte.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    x = torch.randint(0, VOCAB, (2, SEQ))
    lm_loss(model(x).logits, x).backward()
    assert len(calls) == 1
    assert torch.equal(calls[0], wte.grad)  # fired after both uses (embedding and head) accumulated


def test_bucket_plan_reverse_order_skips_frozen_and_respects_size() -> None:
    model = small_model()
    model.transformer.wpe.weight.requires_grad_(False)
    params = list(model.parameters())
    cap = int(BUCKET_MB * 2**20)
    buckets = plan_buckets(params, cap)
    flat = [p for b in buckets for p in b]
    assert flat == [p for p in reversed(params) if p.requires_grad]
    assert all(p is not model.transformer.wpe.weight for p in flat)
    for bucket in buckets:  # a bucket closes once it reaches the cap
        sizes = [p.numel() * p.element_size() for p in bucket]
        assert sum(sizes[:-1]) < cap
    assert len(buckets) > 5


def test_a_bucket_that_reaches_the_cap_exactly_is_closed() -> None:
    """Three 16-byte fp32 parameters with a 32-byte cap, taken last to first: the first two fill the cap exactly and
    close the bucket (size >= cap), so the third starts a new one; a change of dtype starts one too."""
    a, b, c = (nn.Parameter(torch.zeros(4)) for _ in range(3))
    assert plan_buckets([a, b, c], 32) == [[c, b], [a]]
    assert plan_buckets([a, b, c], 33) == [[c, b, a]]  # 32 < 33: still open when a arrives
    half = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    assert plan_buckets([half, a, b], 1000) == [[b, a], [half]]
