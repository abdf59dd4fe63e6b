"""The optimizer and its learning-rate schedule, as GPT-2 training does them."""

from __future__ import annotations

import math

import torch

from gptpar.config import TrainConfig


def learning_rate(step: int, t: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step (step is 0-based)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def make_optimizer(module: torch.nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW that decays matrices only (not biases or norm gains), as GPT-2 training does."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))
