"""parallel.offload on two thread ranks of one real gloo group (tests/thread_ranks.py): zero1 and zero2 with the
optimizer on the host (offload.py), fsdp2 with torch's CPUOffloadPolicy. Each runs the trainer's order of a step
(backward, finish, the clip over the sync's targets, before_step, AdamW, after_step) and must equal the same run
without offload to the bit: on a CPU the host step is the same AdamW on a copy of the same values. The memory count
splits into the device's parts and host_bytes, each the row's closed form (`placed_bytes`) worked by hand for the
MLP; the host's tensors are separate storage from the device's even where both are the CPU."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from thread_ranks import run_threads
from torch import nn

from gptpar.config import ParallelConfig, TrainConfig, load_config
from gptpar.errors import ConfigError
from gptpar.parallel.data_parallel import make_grad_sync
from gptpar.parallel.process_group import group_backend
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.tensor_bytes import storage_key
from gptpar.train.memory import state_bytes
from gptpar.train.optim import clip_gradients, make_optimizer

WORLD = 2
STEPS = 3
MAX_NORM = 0.05  # below the gradients' norm (measured 0.25 to 0.40): every step clips, so the copy must follow the clip
BUILDING = threading.Lock()  # the ranks share torch's default generator: one model built at a time
OFFLOADED = {"zero1": "optimizer", "zero2": "optimizer", "fsdp2": "params"}


def tiny_model() -> nn.Module:
    """N = 16·24 + 24 + 24·8 + 8 = 608 parameters: 304 a rank, no padding (each fsdp2 dim 0 is even)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8))


@dataclass
class RankRun:
    losses: list[float]
    params: dict[str, torch.Tensor]
    memory: dict[str, int]
    shared_storage: bool  # a host tensor shares its storage with a device one


def run(dp_sync: str, offload: str) -> list[RankRun]:
    def rank_main(rank: int) -> RankRun:
        with BUILDING:
            model = tiny_model()
        # bucket_mb: zero1's buckets and zero2's units several (a unit padded to a multiple of W would pad here)
        sync = make_grad_sync(model, ParallelConfig(dp=WORLD, dp_sync=dp_sync, offload=offload, bucket_mb=1.0),
                              dist.group.WORLD)
        optimizer = make_optimizer(sync.optimizer_params(), TrainConfig(lr=0.01, weight_decay=0.1))
        losses, memory = [], {}
        for step in range(STEPS):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank)) + rank
            with sync.accumulating(is_last_micro_step=True):
                loss = sync.module(x).square().mean()
                loss.backward()
            sync.finish()
            targets, group = sync.clip_targets()
            clip_gradients(targets, MAX_NORM, [group] if group is not None else [])
            sync.before_step()
            optimizer.step()
            sync.after_step()
            if step == 0:
                held, _ = sync.clip_targets()
                memory = state_bytes(sync.model, optimizer, held, sync.host_tensors())
            sync.zero_grad()
            losses.append(loss.item())
        host = {storage_key(t) for t in sync.host_tensors() or ()}
        device = {storage_key(p) for p in model.parameters()} | {storage_key(t) for t in sync.clip_targets()[0]}
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in model.named_parameters()}
        return RankRun(losses, params, memory, bool(host & device) and offload == "optimizer")

    return run_threads(WORLD, rank_main)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], list[RankRun]]:
    return {(sync, offload): run(sync, offload) for sync, moved in OFFLOADED.items() for offload in ("none", moved)}


@pytest.mark.parametrize("dp_sync", list(OFFLOADED))
def test_an_offloaded_run_equals_the_run_without_offload_bit_for_bit(runs, dp_sync: str) -> None:
    plain, moved = runs[(dp_sync, "none")], runs[(dp_sync, OFFLOADED[dp_sync])]
    for a, b in zip(plain, moved, strict=True):
        assert b.losses == a.losses  # measured: equal to the bit on a CPU (the same AdamW on the same values)
        for name, value in a.params.items():
            assert torch.equal(b.params[name], value), name
        assert not b.shared_storage
    assert moved[0].losses[-1] != moved[0].losses[0]  # it trained


# The memory count of each rank, by hand for N = 608 over W = 2 (shard 304): device (params, grads, optimizer) and host.
HAND = {("zero1", "none"): (4 * 608, 4 * 608, 8 * 304, None),
        ("zero1", "optimizer"): (4 * 608, 4 * 608, 0, 16 * 304),  # the moments, fp32 master and gradient shards
        ("zero2", "none"): (4 * 608, 4 * 304, 8 * 304, None),
        ("zero2", "optimizer"): (4 * 608, 4 * 304, 0, 16 * 304),
        ("fsdp2", "none"): (4 * 304, 4 * 304, 8 * 304, None),
        ("fsdp2", "params"): (0, 0, 0, 16 * 304)}  # everything sharded on the host


@pytest.mark.parametrize(("dp_sync", "offload"), list(HAND))
def test_the_memory_count_is_the_closed_form_on_device_and_host(runs, dp_sync: str, offload: str) -> None:
    params, grads, optimizer, host = HAND[(dp_sync, offload)]
    device, on_host = DP_STRATEGIES[dp_sync].placed_bytes(608, WORLD, offload)
    assert (params + grads + optimizer, host or 0) == (device, on_host)
    for rank in runs[(dp_sync, offload)]:
        expected = {"params": 608, "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer}
        assert rank.memory == expected | ({"host_bytes": host} if host is not None else {})


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.dp=2", "parallel.tp=2", "parallel.dp_sync=zero2", "parallel.offload=optimizer"],
     "parallel.offload=optimizer is not built with parallel.tp=2; use parallel.tp=1, or parallel.offload=none"),
    (["parallel.dp=2", "parallel.ep=2", "model.preset=mixtral-tiny", "parallel.dp_sync=fsdp2",
      "parallel.offload=params"],
     "parallel.offload=params is not built with parallel.ep=2; use parallel.ep=1, or parallel.offload=none"),
    (["parallel.dp=2", "parallel.pp=2", "parallel.dp_sync=zero1", "parallel.offload=optimizer"],
     "parallel.dp_sync=zero1 does not shard pipeline stages yet; use parallel.dp_sync=naive or bucketed with "
     "parallel.pp > 1"),
])
def test_offload_where_it_is_not_built_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value) == message


def test_fsdp2s_offload_joins_a_cpu_backend_beside_nccl() -> None:
    """On an H200 (torch 2.11, one rank) fsdp2 with CPUOffloadPolicy(pin_memory=True) ran on "cuda:nccl,cpu:gloo", its
    shards and AdamW's state on the host, pinned, its losses within 1.2e-7 of the run without offload."""
    assert group_backend("nccl", "params") == "cuda:nccl,cpu:gloo"
    assert group_backend("nccl", "optimizer") == "nccl"  # zero's collectives and clip stay on the device
    assert group_backend("gloo", "params") == "gloo"
