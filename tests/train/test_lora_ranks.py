"""LoRA (train.lora_rank) under data parallelism on real gloo ranks, with activation checkpointing: each strategy
trains the adapters as one process does on the same global batch, leaves every frozen weight as it was, holds the
training state's closed form (4 bytes per frozen weight, 16 per adapter weight, as the strategy shards them) and
resumes from a checkpoint exactly where an uninterrupted run goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
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

from gptpar.models.lora import adapter_part
from gptpar.parallel.process_group import RankInfo
from gptpar.plan.layout import layout_of
from gptpar.strategies.data_parallel import DP_STRATEGIES

LORA = ["train.lora_rank=4", "train.lora_alpha=8", "train.activation_checkpointing=block"]
SYNCS = [name for name, row in DP_STRATEGIES.items() if not row.without_lora]
CASES = {sync: ["parallel.dp=2", f"parallel.dp_sync={sync}", *LORA] for sync in SYNCS}
CASES["zero2-cp2"] = ["parallel.cp=2", "parallel.dp_sync=zero2", *LORA]  # sharded over the dp x cp replicas
RESUMED = ["ddp", "fsdp2"]


def _worker(info: RankInfo, runs: Path) -> None:
    for name, overrides in CASES.items():
        trainer = make_trainer(make_config(overrides, runs, name), info)
        initial = named_params(trainer)
        record = {"losses": train_steps(trainer, 2), "params": named_params(trainer), "initial": initial,
                  "memory": trainer.memory, "lora": trainer.lora(), "coords": dict(trainer.dims.coords),
                  "val": trainer.evaluate()}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    for name in RESUMED:  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(CASES[name], runs, f"resumed-{name}"), info)
        torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("lora")
    gloo_pool.run(2, _worker, runs)
    return runs


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_lora_trains_only_its_adapters_as_one_process_does(results: Path, name: str) -> None:
    ranks = saved_ranks(results, name)
    ref = reference_run(make_config(CASES[name], results, name))
    assert_trains_like_one_process(ref, ranks, "transformer.wte.weight", name)
    moved = {param for param, value in ranks[0]["params"].items() if not torch.equal(value, ranks[0]["initial"][param])}
    assert moved and all(adapter_part(param) for param in moved), sorted(moved)[:3]  # frozen weights stay put


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_lora_training_state_is_its_closed_form(results: Path, name: str) -> None:
    """The memory record against the header's closed form; a sharding strategy pads each flat shard (ours: a
    unit's; fsdp2: every tensor's dim 0 to a multiple of W), 4 bytes per padded value, at most W - 1 values each."""
    planned = layout_of(make_config(CASES[name], results, name))  # the planner's count of the same config
    for rank in saved_ranks(results, name):
        memory, lora = rank["memory"], rank["lora"]
        assert memory["trainable"] == lora["trainable"] < memory["params"] == lora["params"]
        assert (planned.trainable(0), planned.rank_parameters(0)) == (memory["trainable"], memory["params"])
        held = memory["params_bytes"] + memory["grads_bytes"] + memory["optimizer_bytes"]
        padding = 0 if not DP_STRATEGIES[name.split("-")[0]].sharded else 4 * 2 * len(rank["params"])
        assert lora["state_bytes"] <= held <= lora["state_bytes"] + padding, (held, lora["state_bytes"])


@pytest.mark.parametrize("name", RESUMED)
@pytest.mark.slow
def test_a_resumed_lora_run_continues_bitwise_where_it_stopped(results: Path, name: str) -> None:
    assert_resumed_bitwise(results, name)
