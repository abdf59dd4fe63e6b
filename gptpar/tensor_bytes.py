"""Bytes of tensors, counted by storage: a tied matrix, a gradient bucket or a saved tensor counts once however
many views point into it. Below the trainer and every parallelism, which all measure memory this way.

Activations are counted where autograd keeps them: `SavedBytes` sees every tensor a forward saves for
backward (the recomputed blocks of activation checkpointing save only their input), so what checkpointing
or a pipeline schedule saves is measured the same way on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()  # a shard: this rank's part


def storage_key(t: torch.Tensor) -> int:
    """What tells `t`'s storage apart from others (two views of one buffer share it)."""
    return _storage(t).data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = _storage(t)
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class SavedBytes:
    """While entered, counts the bytes of the distinct storages autograd saves for backward, leaving out those
    of `params` (weights are not activations). A storage saved twice, or by two ops, is counted once."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.excluded = {_storage(p).data_ptr() for p in params}
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        if storage.data_ptr() not in self.excluded:
            self.excluded.add(storage.data_ptr())
            self.total += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def saved_activation_bytes(forward: Callable[[], Any], params: Iterable[torch.Tensor]) -> int:
    """Bytes autograd keeps for backward after one call of `forward` (outside `params`); it is not run backward."""
    with SavedBytes(params) as counter:
        forward()
    return counter.total
