"""The bytes of training state a rank holds, counted from its live tensors.

Parameters, gradients and optimizer state are what the data-parallel strategies trade against each
other (plain replicas hold 4N + 4N + 8N bytes of fp32 state for N parameters with AdamW; sharding
divides some of it by the world size). They are counted by storage (`gptpar.tensor_bytes`, where the
saved activations are counted too), so a tied matrix and a gradient bucket count once. The optimizer's
per-parameter `step` counters (one scalar each) are bookkeeping, not state that scales with the model, and
are left out.

Under parallel.offload the sync names what it keeps on the host (`GradSync.host_tensors`); a gradient and the
optimizer state of a tensor live where the tensor does, so all three are `host_bytes`, and the parts above count
only what stays on the device. On a CPU-only machine host and device are one memory: the split is by what the sync
moved, not by where torch says a tensor is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gptpar.tensor_bytes import storage_bytes, storage_key


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, held: Sequence[torch.Tensor] = (),
                host: Sequence[torch.Tensor] | None = None) -> dict[str, int]:
    """The `memory` record's fields: parameter count (and the trainable count where some are frozen), and bytes of
    parameters, gradients and optimizer state; with `host` (the sync offloads) also host_bytes, those of them on the
    host. `held`: tensors the sync holds gradients in beside the model's and the optimizer's (its clip targets: under
    offload the device's shards). Call it after an optimizer step (AdamW creates its state lazily) and before
    gradients are reset."""
    params = list(model.parameters())
    stepped = [p for group in optimizer.param_groups for p in group["params"]]  # may be shards of `params`
    on_host = {storage_key(t) for t in host or ()}

    def placed(t: torch.Tensor) -> bool:
        return storage_key(t) in on_host

    tensors = [*params, *stepped, *held]
    state = [(p, v) for p, s in optimizer.state.items() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    count = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)  # fewer under train.lora_rank: the adapters
    counts = {"params": count, **({"trainable": trainable} if trainable < count else {}),
              "params_bytes": storage_bytes(p for p in tensors if not placed(p)),  # fsdp: the shards, not the whole
              "grads_bytes": storage_bytes(p.grad for p in tensors if p.grad is not None and not placed(p)),
              "optimizer_bytes": storage_bytes(v for p, v in state if not placed(p))}
    if host is None:
        return counts
    moved = [*host, *(p.grad for p in tensors if p.grad is not None and placed(p)), *(v for p, v in state if placed(p))]
    return counts | {"host_bytes": storage_bytes(moved)}
