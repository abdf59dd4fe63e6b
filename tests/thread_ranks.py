"""Ranks as threads of the test process: each thread joins one real gloo group (over an in-memory store) as its
default group, so code that asks torch.distributed "who am I" (`dist.get_rank()`, `dist.group.WORLD`, DDP) runs
unchanged, and a value-level check of a sync stays in the fast tier (no process is started).

torch keeps the default group in one module-level registry; torch's own threaded-rank tests swap it for a per-thread
one (`ThreadLocalWorld`), which is done here for the duration of one `run_threads` call only. torch also registers
group names once per process, so each rank names its groups from its own offset (GROUP_NAMES) and its store
(`RankStore`) maps them back to the shared names under which the ranks meet. Only the default group: a subgroup
(`dist.new_group`) asks the store for more than a Python store gives. What is process-wide stays shared by the
threads: torch's default random generator (a hook that seeds and draws from it races with its peers), and DDP's
class-wide "active module" that dynamo reads: its save-and-restore around each forward, interleaved by the threads,
can leave one rank's module set after all have returned (every later torch.compile in the process then took the DDP
optimizer's path and failed), and torch.__future__'s swap-on-conversion flag, which materialising a model sets and
restores around itself (interleaved, one thread restores the other's True): run_threads puts both back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

T = TypeVar("T")
# Group names are registered process-wide (torch's C++ registry): rank r names its groups from r * GROUP_NAMES on.
GROUP_NAMES = 1000
TIMEOUT_S = 120  # a rank that failed leaves its peers in a collective: gloo gives up after this


class RankStore(dist.Store):
    """Rank `rank`'s view of the shared store: its group names (offset by rank * GROUP_NAMES) mapped back to the
    names every rank's groups share, so that the ranks of one group meet under one prefix."""

    def __init__(self, shared: dist.Store, rank: int):
        super().__init__()
        self.shared, self.offset = shared, rank * GROUP_NAMES

    def _key(self, key: str) -> str:
        name, slash, rest = key.partition("/")
        return f"{int(name) - self.offset}{slash}{rest}" if slash and name.isdigit() else key

    def set(self, key: str, value: bytes) -> None:
        self.shared.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self.shared.get(self._key(key))

    def add(self, key: str, value: int) -> int:
        return self.shared.add(self._key(key), value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.shared.compare_set(self._key(key), expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.shared.check([self._key(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = [self._key(k) for k in keys]
        self.shared.wait(keys) if timeout is None else self.shared.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.shared.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.shared.num_keys()


def run_threads(world: int, fn: Callable[[int], T]) -> list[T]:
    """fn(rank) on `world` threads, each rank `rank` of one gloo group of `world`; their results in rank order.
    The first rank's exception is raised after all threads are done."""
    if dist.is_initialized():  # a rank's teardown unregisters every group name of the process (torch's registry)
        raise RuntimeError("run_threads: this process already has a default group; its ranks would unregister it")
    store = dist.HashStore()
    results: list[T | None] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def rank_main(rank: int) -> None:
        c10d._world.group_count = rank * GROUP_NAMES  # this rank's groups get names no other rank's have
        dist.init_process_group("gloo", store=RankStore(store, rank), rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
        try:
            results[rank] = fn(rank)
            dist.barrier()  # no rank leaves the group while a peer still uses it
        except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
            errors[rank] = exc
        finally:
            dist.destroy_process_group()

    saved, active_ddp = c10d._world, DistributedDataParallel._active_ddp_module
    swap = torch.__future__.get_swap_module_params_on_conversion()
    c10d._world = ThreadLocalWorld()
    try:
        threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}", daemon=True)
                   for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * TIMEOUT_S)
    finally:
        c10d._world = saved
        DistributedDataParallel._active_ddp_module = active_ddp
        torch.__future__.set_swap_module_params_on_conversion(swap)
    if error := next((e for e in errors if e is not None), None):
        raise error
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"ranks still running after {2 * TIMEOUT_S} s")
    return results  # type: ignore[return-value]
