"""The data-parallel strategies (`parallel.dp_sync`) as one table: for each, the class that runs it, what it
shards over the replicas, what it composes with, and its memory closed form. The config's choices and checks,
the trainer's choice of sync, the report's memory check and the planner all read this table; a new strategy
is one module under gptpar/parallel/data_parallel/ (a GradSync with `from_setup`) plus one row here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gptpar.errors import ConfigError

if TYPE_CHECKING:
    from gptpar.config import Config

# Bytes per parameter of fp32 AdamW training state (weight, gradient, two moments), in the parts a strategy
# may shard over its W replicas; every rank holds the parts it does not shard whole.
STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}
# parallel.grad_comm: how gradients cross the wire. The half types all-reduce in bf16 or fp16; int8 is our reducers'
# blockwise quantisation (an all-to-all and an all-gather), powersgd torch's low-rank hook for DDP.
HALF = ("fp32", "bf16", "fp16")
GRAD_COMMS = (*HALF, "int8", "powersgd")


@dataclass(frozen=True)
class DataParallelStrategy:
    """One row: `sync` is "module:Class" of its GradSync, imported only when a rank builds it (this table
    stays torch-free)."""

    sync: str
    help: str
    sharded: tuple[str, ...] = ()  # parts of STATE_BYTES split over the replicas
    without_pipeline: str = ""  # why it cannot sync a stage of the multi-process pipeline; "" if it can
    tensor_parallel: tuple[str, ...] = ("gptpar",)  # parallel.tp_impl values it composes with at dp > 1
    materialises_shards: bool = False  # with model.init_device=meta it builds only its shards itself
    without_whole_compile: str = ""  # why train.compile=model cannot capture its model in one graph; "" if it can
    grad_comm: tuple[str, ...] = ("fp32",)  # the parallel.grad_comm types it sends gradients in
    expert_parallel: bool = False  # syncs the dense parameters only, beside parallel.ep's expert shards

    @property
    def whole_gradients(self) -> bool:
        """Every rank holds the whole averaged gradient after the sync (what train.dump_grads saves)."""
        return "grads" not in self.sharded

    def state_bytes(self, n: float, w: int) -> float:
        """Bytes of training state one rank holds for n parameters over w replicas, unpadded: the closed form a
        measured count is checked against."""
        return math.fsum(n * size / (w if part in self.sharded else 1) for part, size in STATE_BYTES.items())


_PACKAGE = "gptpar.parallel.data_parallel"
_NOT_SHARDED_YET = "does not shard pipeline stages yet"

DP_STRATEGIES: dict[str, DataParallelStrategy] = {
    "naive": DataParallelStrategy(f"{_PACKAGE}.naive:NaiveSync", "all-reduce per parameter",
                                  grad_comm=(*HALF, "int8"), expert_parallel=True),
    "bucketed": DataParallelStrategy(f"{_PACKAGE}.bucketed:BucketedSync", "overlapped flat buckets",
                                     grad_comm=(*HALF, "int8"), expert_parallel=True),
    "ddp": DataParallelStrategy(
        f"{_PACKAGE}.ddp:DDPSync", "torch DDP",
        without_pipeline="cannot sync a pipeline stage (DDP reduces inside every backward, the engine runs many "
                         "per step)", grad_comm=(*HALF, "powersgd"), expert_parallel=True),
    "zero1": DataParallelStrategy(f"{_PACKAGE}.zero:ZeroOneSync", "bucketed, optimizer state sharded",
                                  ("optimizer",), _NOT_SHARDED_YET, grad_comm=HALF, expert_parallel=True),
    "zero2": DataParallelStrategy(f"{_PACKAGE}.zero:ZeroTwoSync", "gradients sharded too",
                                  ("grads", "optimizer"), _NOT_SHARDED_YET, grad_comm=(*HALF, "int8"),
                                  expert_parallel=True),
    "fsdp": DataParallelStrategy(f"{_PACKAGE}.fsdp:FSDPSync", "ours, ZeRO-3: parameters sharded too, gathered "
                                 "per block", ("params", "grads", "optimizer"), _NOT_SHARDED_YET,
                                 materialises_shards=True, grad_comm=(*HALF, "int8"),
                                 without_whole_compile="gathers and frees each block's parameters in hooks around the "
                                                       "block, which one whole-model graph cannot hold"),
    "fsdp2": DataParallelStrategy(f"{_PACKAGE}.fsdp2:FSDP2Sync", "torch's fully_shard, the same units",
                                  ("params", "grads", "optimizer"), _NOT_SHARDED_YET, tensor_parallel=("torch",),
                                  grad_comm=HALF, expert_parallel=True),
}


def closed_form_state_bytes(strategy: str, n: float, w: int) -> float | None:
    """`DataParallelStrategy.state_bytes` of a named strategy; None for a name the table lacks (an old log)."""
    row = DP_STRATEGIES.get(strategy)
    return row.state_bytes(n, w) if row is not None else None


def either(names: list[str]) -> str:
    """`a, b or c`: the allowed values an error message offers."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def check(cfg: Config) -> None:
    """train.dump_grads against what the strategy (and tensor parallelism) leaves each rank, parallel.grad_comm
    against what it can send, then parallel.dp_sync against the multi-process pipeline."""
    p = cfg.parallel
    row = DP_STRATEGIES[p.dp_sync]
    if cfg.train.dump_grads and (p.tp > 1 or (p.dp > 1 and not row.whole_gradients)):
        split = f"parallel.tp={p.tp}" if p.tp > 1 else f"parallel.dp_sync={p.dp_sync}"
        whole = [name for name, r in DP_STRATEGIES.items() if r.whole_gradients]
        raise ConfigError(f"train.dump_grads saves whole gradients, but {split} leaves each rank pieces of them; "
                          f"use parallel.dp_sync={either(whole)} with parallel.tp=1, or leave it empty")
    if p.grad_comm not in row.grad_comm:
        sending = [name for name, r in DP_STRATEGIES.items() if p.grad_comm in r.grad_comm]
        raise ConfigError(f"parallel.grad_comm={p.grad_comm} is not built for parallel.dp_sync={p.dp_sync} (it sends "
                          f"{either(list(row.grad_comm))}); use parallel.dp_sync={either(sending)}, or "
                          "parallel.grad_comm=fp32")
    if p.pp > 1 and row.without_pipeline:
        syncing = [name for name, r in DP_STRATEGIES.items() if not r.without_pipeline]
        raise ConfigError(f"parallel.dp_sync={p.dp_sync} {row.without_pipeline}; use parallel.dp_sync="
                          f"{either(syncing)} with parallel.pp > 1")
