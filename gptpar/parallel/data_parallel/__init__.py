"""Data parallelism: one gradient-sync interface over every strategy, so the trainer's loop is the same:

    sync = make_grad_sync(model, cfg.parallel, dims.group("dp"))
    for i, (x, y) in enumerate(micro_batches):
        with sync.accumulating(is_last_micro_step=i == len(micro_batches) - 1):
            (lm_loss(sync.module(x), y) / len(micro_batches)).backward()
    sync.finish()          # now every replica's .grad holds the average over the dp group
    optimizer.step()       # optimizer built on sync.model.parameters()
    sync.zero_grad()       # not optimizer.zero_grad(): keeps the bucketed reducer copy-free

Which class runs `parallel.dp_sync` is the strategy's row of gptpar/strategies/data_parallel.py: naive (the
assignment's per-parameter all-reduce, naive.py), bucketed (our overlapped reducer, bucketed.py), ddp (torch's
DistributedDataParallel as the reference, ddp.py), zero1/zero2 (optimizer state, then gradients too, sharded;
zero.py on sharded.py), fsdp (ours, parameters sharded too and gathered per block, fsdp.py), fsdp2 (torch's
fully_shard on the same units, fsdp2.py), deepspeed (DeepSpeed's engine at parallel.zero_stage, deepspeed.py, imported
only when chosen). The trainer steps through sync.step(), which clips, calls before_step() (parallel.offload=optimizer
copies gradients to the host), optimizer.step() and after_step() (the shards back, then the all-gather),
builds the optimizer on sync.optimizer_params() (a sharded optimizer steps shards of the parameters) and clips
over sync.clip_targets().
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gptpar.config import ParallelConfig, TrainConfig
from gptpar.parallel.data_parallel.base import GradSync, InitialValue, SyncSetup, broadcast_state
from gptpar.parallel.data_parallel.bucketed import BucketedSync
from gptpar.parallel.data_parallel.ddp import DDPSync
from gptpar.parallel.data_parallel.fsdp import FSDPSync
from gptpar.parallel.data_parallel.fsdp2 import FSDP2Sync
from gptpar.parallel.data_parallel.naive import NaiveSync, average_gradients
from gptpar.parallel.data_parallel.zero import ZeroOneSync, ZeroTwoSync
from gptpar.strategies.data_parallel import DP_STRATEGIES

__all__ = ["BucketedSync", "DDPSync", "FSDP2Sync", "FSDPSync", "GradSync", "InitialValue", "NaiveSync",
           "ZeroOneSync", "ZeroTwoSync", "average_gradients", "broadcast_state", "make_grad_sync"]


def make_grad_sync(model: nn.Module, pcfg: ParallelConfig, group: dist.ProcessGroup | None,
                   device: torch.device | None = None, initial: InitialValue | None = None,
                   mesh: DeviceMesh | None = None, local: frozenset[str] = frozenset(),
                   node_group: dist.ProcessGroup | None = None, train: TrainConfig | None = None) -> GradSync:
    """The strategy named by parallel.dp_sync over `group` (the grid's dp group); a no-op without one, but for a row
    that runs `alone` (deepspeed), which then makes a group of one itself.
    The model must already be on its device and identical on all replicas up to a broadcast from the
    group's first rank (done here), except for a strategy that materialises its shards (fsdp) given
    `initial`: then it is on the meta device and the strategy materialises this rank's shards on `device`.
    `mesh` is the group's DeviceMesh within the job's grid, which fsdp2 needs to shard parameters that
    torch's tensor parallelism already made DTensors on the grid. `local` names the parameters the strategy leaves
    alone (parallel.ep's expert slices); `node_group` is this rank's data-parallel ranks on its node (parallel.hpz);
    `train` the optimizer's settings, for a strategy whose engine builds its optimizer (deepspeed).
    """
    row = DP_STRATEGIES[pcfg.dp_sync]
    if group is None and not row.alone:
        return GradSync(model)
    module, _, name = row.sync.partition(":")
    strategy = getattr(importlib.import_module(module), name)
    return strategy.from_setup(SyncSetup(model, group, pcfg, device or next(model.parameters()).device, initial,
                                         mesh, local, node_group, train))
