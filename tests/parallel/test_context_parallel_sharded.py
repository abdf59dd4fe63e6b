"""Context parallelism under every sharding data-parallel strategy: zero1, zero2, our fsdp, fsdp2 and DeepSpeed shard
the training state over the dp x cp ranks (ParallelDims.replica_group, W = dp * cp) and average over them; zero1, zero2
and our fsdp do so under our tensor parallelism too (cp=2 x tp=2: each tp rank's pieces over its cp ranks).

Each case is one short run through the trainer's own step on the shared gloo pool (dp=1 x cp=2 on 2 ranks, dp=2 x
cp=2 and cp=2 x tp=2 on 4), against one process on the same global batch; its `memory` record is the strategy's
closed form at W = dp * cp to the byte (BASE's units and rows divide by 2 and 4, so nothing is padded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
    STEPS,
    assert_resumed_bitwise,
    assert_trains_like_one_process,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    saved_ranks,
    train_steps,
)

from gptpar.config import load_config
from gptpar.parallel.data_parallel.deepspeed import deepspeed_config
from gptpar.parallel.process_group import RankInfo
from gptpar.strategies.data_parallel import closed_form_state_bytes

SHARDED = ("zero1", "zero2", "fsdp", "fsdp2")
CASES = {f"{sync}-dp{dp}-cp2": [f"parallel.dp={dp}", "parallel.cp=2", f"parallel.dp_sync={sync}",
                                 "parallel.bucket_mb=0.01"]  # zero2: several buckets
         for dp in (1, 2) for sync in SHARDED}
CASES["deepspeed-dp1-cp2"] = ["parallel.cp=2", "parallel.dp_sync=deepspeed", "parallel.bucket_mb=0.01"]
CASES["zero2-offload-dp1-cp2"] = [*CASES["zero2-dp1-cp2"], "parallel.offload=optimizer"]
for sync in ("zero1", "zero2", "fsdp"):  # the syncs that shard our tensor-parallel pieces, over the cp ranks
    CASES[f"{sync}-cp2-tp2"] = ["parallel.cp=2", "parallel.tp=2", f"parallel.dp_sync={sync}", "parallel.bucket_mb=0.01"]
STATE = ("params_bytes", "grads_bytes", "optimizer_bytes", "host_bytes")  # the memory record's parts


def _train(info: RankInfo, runs: Path, name: str) -> None:
    """STEPS steps of the case, saving what assert_trains_like_one_process reads and the memory record."""
    trainer = make_trainer(make_config(CASES[name], runs, name), info)
    losses = train_steps(trainer, STEPS)
    record = {"losses": losses, "params": named_params(trainer), "coords": dict(trainer.dims.coords),
              "val": trainer.evaluate(), "memory": trainer.memory}
    torch.save(record, runs / f"{name}.rank{info.rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_sharded_sync_with_cp_trains_like_one_process_and_holds_its_closed_form_over_dp_x_cp(
        name: str, tmp_path: Path, gloo_pool: GlooPools) -> None:
    cfg = make_config(CASES[name], tmp_path, name)
    p = cfg.parallel
    gloo_pool.run(p.dp * p.cp * p.tp, _train, tmp_path, name)
    ranks = saved_ranks(tmp_path, name)
    assert_trains_like_one_process(reference_run(cfg), ranks, "transformer.wte.weight", name)
    for rank in ranks:
        memory = rank["memory"]
        closed = closed_form_state_bytes(p.dp_sync, memory["params"], p.dp * p.cp, p.offload,
                                         zero_stage=p.zero_stage)
        assert sum(memory.get(part, 0) for part in STATE) == closed, name


def _resume(info: RankInfo, runs: Path, name: str) -> None:
    """The case's straight run and its resumed one (a step, a checkpoint, a new trainer, a step)."""
    _train(info, runs, name)
    resumed = resumed_run(make_config(CASES[name], runs, f"resumed-{name}"), info)
    torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp-dp1-cp2", "fsdp2-dp1-cp2"])
def test_a_sharded_cp_run_resumes_bitwise(name: str, tmp_path: Path, gloo_pool: GlooPools) -> None:
    """Each rank's shard over dp x cp, saved and loaded back (our fsdp's pieces, fsdp2's DTensors)."""
    gloo_pool.run(2, _resume, tmp_path, name)
    assert_resumed_bitwise(tmp_path, name)


def test_every_strategy_takes_cp() -> None:
    """(hpZ's refusal under cp is with the other one-line refusals, test_context_parallel.py.)"""
    for sync in (*SHARDED, "deepspeed"):
        cfg = load_config(None, ["data.seq_len=16", "parallel.cp=2", "parallel.dp=2", f"parallel.dp_sync={sync}"])
        assert (cfg.parallel.cp, cfg.parallel.dp_sync) == (2, sync)


def test_deepspeed_counts_each_replicas_rows_once_per_cp_rank() -> None:
    """dp=2 x cp=2, 8 rows a step in 2 micro-steps: each rank's micro-batch is its replica's 2 rows (shards of them),
    and DeepSpeed's train_batch_size = 2 rows x 2 micro-steps x its 4 ranks."""
    cfg = load_config(None, ["parallel.dp=2", "parallel.cp=2", "parallel.dp_sync=deepspeed", "train.batch_size=8",
                             "train.grad_accum=2", "data.seq_len=16"])
    config = deepspeed_config(cfg.parallel, cfg.train, 2, "fp32", 1)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (2, 2, 16)
