"""The bytes of training state a rank holds, counted from its live tensors.

Parameters, gradients and optimizer state are what the data-parallel strategies trade against each
other (plain replicas hold 4N + 4N + 8N bytes of fp32 state for N parameters with AdamW; sharding
divides some of it by the world size). They are counted by storage (`gptpar.tensor_bytes`, where the
saved activations are counted too), so a tied matrix and a gradient bucket count once. The optimizer's
per-parameter `step` counters (one scalar each) are bookkeeping, not state that scales with the model, and
are left out.
"""

from __future__ import annotations

import torch
from torch import nn

from gptpar.tensor_bytes import storage_bytes


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The `memory` record's fields: parameter count (and the trainable count where some are frozen), and bytes of
    parameters, gradients and optimizer state. Call it after an optimizer step (AdamW creates its state lazily)
    and before gradients are reset."""
    params = list(model.parameters())
    stepped = [p for group in optimizer.param_groups for p in group["params"]]  # may be shards of `params`
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    count = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)  # fewer under train.lora_rank: the adapters
    return {"params": count, **({"trainable": trainable} if trainable < count else {}),
            "params_bytes": storage_bytes([*params, *stepped]),  # fsdp: the shards; its whole parameters are freed
            "grads_bytes": storage_bytes(p.grad for p in [*params, *stepped] if p.grad is not None),
            "optimizer_bytes": storage_bytes(state)}
