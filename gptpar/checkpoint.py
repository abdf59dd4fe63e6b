"""Checkpoints written atomically, so a job killed mid-save leaves the previous one intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gptpar.atomic import atomic_write

CHECKPOINT_FILE = "checkpoint.pt"


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_FILE


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    path = checkpoint_path(run_dir)
    atomic_write(path, lambda f: torch.save(state, f))
    return path


def load_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's checkpoint, loaded on the CPU (the caller's load_state_dict moves tensors), or None."""
    path = checkpoint_path(run_dir)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
