"""The optimizer and its learning-rate schedule, as GPT-2 training does them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_fused_kernels_supported_devices

from gptpar.config import TrainConfig

# How AdamW updates: one fused kernel over all tensors, one kernel per operation over all of them, or a loop over the
# tensors (what torch itself picks on CPUs; on GPUs it picks foreach).
OPTIMIZER_KINDS = ("fused", "foreach", "for-loop")


def learning_rate(step: int, t: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step, total_steps - 1 (step is 0-based):
    decaying over total_steps - warmup_steps steps would end one step after the run, which never trains at min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - 1 - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def optimizer_kind(tensors: list[torch.Tensor], fused: bool) -> str:
    """Which AdamW implementation runs (OPTIMIZER_KINDS). With train.fused_optimizer the fused kernel where torch has
    one for every tensor's device and dtype (torch checks only at the first step, so this checks here), else
    foreach; without it torch's own default, named."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    if fused and all(t.device.type in _get_fused_kernels_supported_devices() and t.is_floating_point() for t in local):
        return "fused"
    if fused:
        return "foreach"
    return "foreach" if _default_to_fused_or_foreach(local, differentiable=False)[1] else "for-loop"


def make_optimizer(params: list[tuple[torch.Tensor, bool]], t: TrainConfig) -> torch.optim.AdamW:
    """AdamW over (tensor, decays) pairs: matrices are decayed, biases and norm gains not, as GPT-2
    training does (the pairs come from the gradient sync, whose tensors may be shards of parameters); a kind with no
    tensors (LoRA's adapters are all matrices) gets no group, which torch's checkpoint reader cannot take.
    `optimizer_kind` picks the implementation; all give the same update up to fp32 rounding."""
    groups = [{"params": part, "weight_decay": decay} for decays, decay in ((True, t.weight_decay), (False, 0.0))
              for part in _one_kind_each([p for p, d in params if d == decays]) if part]  # LoRA's: matrices only
    kind = optimizer_kind([p for p, _ in params], t.fused_optimizer)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), **flags)


def _one_kind_each(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` as one group, or two where DTensors (FSDP2's shards) sit beside plain tensors (parallel.ep's expert
    slices): torch's fused and foreach kernels take one kind per group."""
    dtensors = [p for p in tensors if isinstance(p, DTensor)]
    plain = [p for p in tensors if not isinstance(p, DTensor)]
    return [dtensors, plain] if dtensors and plain else [tensors]


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    """The OPTIMIZER_KINDS name of what `make_optimizer` built, for the log header; of an engine's wrapper
    (DeepSpeed's ZeRO optimizer), of the torch optimizer it steps, its `.optimizer`."""
    defaults = optimizer.defaults if hasattr(optimizer, "defaults") else optimizer.optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    return "foreach" if defaults.get("foreach") else "for-loop"


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, groups: Sequence[dist.ProcessGroup] = (),
                   counted: list[torch.nn.Parameter] | None = None) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most max_norm (inf: only measure); returns the norm, a
    scalar tensor on the device: nothing here waits for the device (the scale factor is computed there, as torch's
    clip_grad_norm_ does).

    Without groups this is torch's clip_grad_norm_. With them (pipeline stages, shards, tensor-parallel pieces),
    the squares are summed over each group's ranks in turn, each rank counting only `counted` (a tensor held by
    several ranks, as the tied embedding or a replicated layer norm is, is counted once), so every rank scales
    by the same factor one process would.
    """
    if not groups:  # also for DTensor gradients (FSDP2, torch's TP), whose norm torch sums over their shards
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    # A DTensor gradient among them (FSDP2 beside parallel.ep's plain expert slices): its local shard, in place.
    held = [(p, p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params if p.grad is not None]
    grads = [grad for _, grad in held]
    ids = {id(p) for p in (counted if counted is not None else params)}
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for p, grad in held:
        if id(p) in ids:  # summed in fp64 without an fp64 copy of the gradient (a quarter of the time on a CPU)
            squares += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
    for group in groups:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    if math.isfinite(max_norm) and grads:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).float())
    return norm
