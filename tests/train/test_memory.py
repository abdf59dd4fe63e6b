"""The `memory` record's counts (gptpar.train.memory.state_bytes) to the byte, in one process: fp32 AdamW holds 4N of
parameters, 4N of gradients and 8N of moments; its per-parameter step counters are left out; a sharding sync's
optimizer steps shards, whose gradients are counted beside the model's."""

from __future__ import annotations

import torch
from torch import nn

from gptpar.train.memory import state_bytes


def _stepped(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over `params` after one step on gradients of ones (AdamW creates its state lazily)."""
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def test_a_replica_holds_4n_4n_and_8n_bytes_without_step_counters() -> None:
    model = nn.Linear(4, 4)  # N = 16 + 4
    counts = state_bytes(model, _stepped(list(model.parameters())))
    assert counts == {"params": 20, "params_bytes": 80, "grads_bytes": 80, "optimizer_bytes": 160}


def test_a_sharded_optimizers_shard_and_its_gradient_are_counted() -> None:
    """As zero2 holds them: the model's parameters, without gradients, beside the 10-value shard the optimizer
    steps, whose gradient and moments are this rank's only."""
    model = nn.Linear(4, 4)
    counts = state_bytes(model, _stepped([nn.Parameter(torch.zeros(10))]))
    assert counts == {"params": 20, "params_bytes": 80 + 40, "grads_bytes": 40, "optimizer_bytes": 80}
