"""The assignment's saved-gradient check: after the run's last step each rank writes its gradients to
`model<RANK>_gradients.pth`, a dict {GPT-2 parameter name: tensor on the CPU} holding the parameters that have
one (the assignment's own format, so its two-rank equality test loads them unchanged). They are taken after the
data-parallel sync and before the gradients are zeroed: what the last optimizer step applied, the same on
every replica when the sync works.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from gptpar.atomic import atomic_write


def dump_gradients(params: Mapping[str, torch.Tensor], folder: str | Path, rank: int) -> None:
    """Write the gradients of `params` (a rank's parameters by name) as global rank `rank`'s file, atomically.
    Copies: a bucketed reducer's gradients are views of its buckets, whose whole storage torch.save would write."""
    grads = {name: p.grad.detach().to("cpu", copy=True) for name, p in params.items() if p.grad is not None}
    atomic_write(Path(folder) / f"model{rank}_gradients.pth", lambda f: torch.save(grads, f))
