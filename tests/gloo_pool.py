"""One shared set of gloo ranks per world size, started once per test session and reused by every equality test.

Starting W fresh Python processes costs W imports of torch and transformers (about 5 s each on two cores), which
used to be paid again by every module's fixture. A pool rank keeps its process group and runs each function it is
sent, `fn(rank_info, *args)` as `spawn_local` would, with the calling test's environment and working folder (a
task may also leave the group, as `gptpar.train.entry.run_rank` does: the next one joins a fresh one). The
first failure tears the pool down (its peers may be stuck in a collective) and is raised naming its rank, and the
next call starts a fresh pool.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as distributed_c10d
import torch.multiprocessing as mp

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError
from gptpar.parallel.env import LAUNCHER_MARKER, free_port
from gptpar.parallel.flight import frames
from gptpar.parallel.process_group import destroy_distributed, init_distributed

TASK_TIMEOUT_S = 900  # a whole module's cases on 8 ranks sharing two cores
# Groups a pool rank may hold before the pool is restarted: torch never frees a task's device meshes and new groups
# while their process group lives, and each keeps gloo threads that wake to poll: ranks that kept a slow tier's
# worth (1,100 threads each) spent the two cores on system time. Destroying them in a live group is not safe (DTensor
# caches the meshes that name them), so the pool starts afresh instead (a few times a run, a few seconds each).
MAX_GROUPS = 100
WORLD_TIMEOUT_S = 60  # the pool's parallel.timeout_s
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", LAUNCHER_MARKER)


def _serve(index: int, world_size: int, tasks: Any, results: Any) -> None:
    """A pool rank: run each task sent in the group (joined at the first, and again after a task that left it),
    reporting (rank, time, error or None, the groups it now holds)."""
    while (task := tasks.get()) is not None:
        fn, args, env, cwd, port = task
        os.environ.clear()
        os.environ.update({**env, "RANK": str(index), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(index),
                           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           LAUNCHER_MARKER: "spawn"})
        os.chdir(cwd)
        try:
            pcfg = ParallelConfig(dp=world_size, backend="gloo", timeout_s=WORLD_TIMEOUT_S)
            info = init_distributed(pcfg)  # a no-op if joined
            fn(info, *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which names the rank
            results.put((index, time.time(), _describe(exc), _groups()))
        else:
            results.put((index, time.time(), None, _groups()))
    if dist.is_initialized():
        dist.barrier()  # as spawn_local does: no rank tears the group down while a peer still uses it
    destroy_distributed()


def _describe(exc: BaseException) -> str:
    """The error's first line and where it was raised (as a hang dump shows a frame, flight.frames): the innermost
    frame, and the innermost outside site-packages when that is another one (torch's own checks say little without
    their caller)."""
    shown = frames(traceback.extract_tb(exc.__traceback__))
    ours = [frame for frame in shown if "/site-packages/" not in frame[0]]
    places = list(dict.fromkeys(f"{file}:{line} ({function})" for file, line, function in shown[-1:] + ours[-1:]))
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line} [at {' from '.join(places)}]"


def _groups() -> int:
    """Process groups this rank holds (0 outside a group)."""
    return len(distributed_c10d._world.pg_map) if dist.is_initialized() else 0


class GlooPool:
    """`world_size` ranks in one gloo group, started on first use."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._processes: list[Any] = []

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._tasks = [context.SimpleQueue() for _ in range(self.world_size)]
        self._results = context.Queue()
        self._processes = [context.Process(target=_serve, args=(i, self.world_size, self._tasks[i], self._results),
                                           daemon=True)
                           for i in range(self.world_size)]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(rank_info, *args) on every rank; returns when all are done, raises naming the first that failed."""
        if not self._processes:
            self._start()
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
        port = free_port()  # where the ranks meet if they are not in a group (the first task, or after one left)
        for tasks in self._tasks:
            tasks.put((fn, args, env, os.getcwd(), port))
        failures = []
        done, groups = 0, 0
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while done < self.world_size and not failures:
            try:
                rank, when, error, held = self._results.get(timeout=1)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._processes) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    reason = f"rank {dead[0]} died" if dead else f"ranks hung past {TASK_TIMEOUT_S} s"
                    raise GptparError(reason) from None
                continue
            done, groups = done + 1, max(groups, held)
            if error is not None:
                failures.append((when, rank, error))
        if failures:
            time.sleep(2)  # peers of a failed rank fail soon after; the earliest failure is the one to name
            while not self._results.empty():
                rank, when, error, _ = self._results.get()
                if error is not None:
                    failures.append((when, rank, error))
            self.close(force=True)
            _, rank, error = min(failures)
            raise GptparError(f"rank {rank} failed: {error}")
        if groups > MAX_GROUPS:
            self.close()

    def close(self, force: bool = False) -> None:
        """Stop every rank: politely when idle, by force when one may be stuck in a collective."""
        if not force:
            for tasks in self._tasks if self._processes else []:
                tasks.put(None)
        for process in self._processes:
            process.join(timeout=0 if force else 10)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes = []


class GlooPools:
    """The session's pools, one per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, GlooPool] = {}

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any) -> None:
        self._pools.setdefault(world_size, GlooPool(world_size)).run(fn, *args)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
