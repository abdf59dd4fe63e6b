"""Tensor parallelism's implementations (`parallel.tp_impl`) as a table, and its own keys' check: parallel.tp
against the model's shape, the sequence, the pipeline and the data-parallel strategies (whose rows say which
implementations each composes with)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gptpar.errors import ConfigError
from gptpar.strategies.data_parallel import DP_STRATEGIES, either

if TYPE_CHECKING:
    from gptpar.config import Config


@dataclass(frozen=True)
class TensorParallelImpl:
    help: str
    with_pipeline: bool  # composes with the multi-process pipeline (parallel.pp > 1)


TP_IMPLS: dict[str, TensorParallelImpl] = {
    "gptpar": TensorParallelImpl("ours, Megatron-style (on GPT-2's Conv1D, the Llama family's Linear)",
                                 with_pipeline=True),
    "torch": TensorParallelImpl("torch.distributed.tensor.parallel on the same plan", with_pipeline=False),
}


def check(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    shape = m.shape()
    mlp = "the MLP width 4 * model.n_embd" if shape.arch == "gpt2" else "the MLP width"
    for key, value in (("model.n_head", shape.n_head), ("model.n_kv_head", shape.kv_heads), (mlp, shape.mlp_width)):
        if value % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} must divide {key}={value}; use a tp that divides it")
    if p.sequence_parallel and cfg.data.task == "lm" and cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true splits data.seq_len={cfg.data.seq_len} into parallel.tp="
                          f"{p.tp} shards; use a seq_len that is a multiple of {p.tp}")
    if p.pp_mode != "single":
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} drives stages from one process and cannot be combined with "
                          f"parallel.tp={p.tp}; use parallel.pp (the multi-process pipeline) instead")
    if p.pp > 1 and not TP_IMPLS[p.tp_impl].with_pipeline:
        composing = [name for name, impl in TP_IMPLS.items() if impl.with_pipeline]
        raise ConfigError(f"parallel.tp_impl={p.tp_impl} does not compose with parallel.pp > 1; use parallel.tp_impl="
                          f"{either(composing)} for pipeline x tensor parallelism")
    row = DP_STRATEGIES[p.dp_sync]
    if p.dp > 1 and p.tp_impl not in row.tensor_parallel:
        syncs = [name for name, r in DP_STRATEGIES.items() if p.tp_impl in r.tensor_parallel]
        same = [name for name in syncs if DP_STRATEGIES[name].sharded == row.sharded]
        others = [name for name in TP_IMPLS if name in row.tensor_parallel]
        if same:  # the strategy that shards the same state the way this implementation's parameters need
            offer = f"use parallel.dp_sync={same[0]} ({DP_STRATEGIES[same[0]].help.split(',')[0]}) instead"
        else:
            offer = f"it needs parallel.dp_sync={either(syncs)}"
        alternative = f"; or use parallel.tp_impl={either(others)}" if others else ""
        raise ConfigError(f"parallel.tp_impl={p.tp_impl} with parallel.dp={p.dp} does not compose with "
                          f"parallel.dp_sync={p.dp_sync}: {offer}{alternative}")
