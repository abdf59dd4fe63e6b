"""The strategy tables are the one place a strategy is known: every row builds, the config's choices and checks,
the README reference and the memory closed form read the rows, and a new data-parallel strategy is one module
(here, this file) plus one row: it then trains exactly like one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import GlooPools
from rank_training import STEPS, make_config, make_trainer, named_params, reference_run, saved_ranks, train_steps
from torch import nn

from gptpar.config import ConfigError, load_config, reference_markdown
from gptpar.parallel.data_parallel.base import GradSync, SyncSetup, broadcast_state
from gptpar.parallel.process_group import RankInfo
from gptpar.strategies.data_parallel import DP_STRATEGIES, DataParallelStrategy, closed_form_state_bytes
from gptpar.strategies.pipeline import SCHEDULES, schedule_shape


class SumThenDivide(GradSync):
    """The example strategy, not shipped: after backward, every gradient summed over the group, then divided."""

    name = "sum_then_divide"

    def __init__(self, model: nn.Module, group: dist.ProcessGroup):
        super().__init__(model)
        self.group = group
        broadcast_state(model, group)

    @classmethod
    def from_setup(cls, setup: SyncSetup) -> GradSync:
        return cls(setup.model, setup.group)

    def finish(self) -> None:
        world = dist.get_world_size(self.group)
        for param in self.model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=self.group)
                param.grad /= world


EXAMPLE = DataParallelStrategy(f"{__name__}:SumThenDivide", "the tests' example", without_pipeline="is an example")


def test_every_row_names_a_grad_sync_built_from_a_setup() -> None:
    import importlib

    for name, row in DP_STRATEGIES.items():
        module, _, cls = row.sync.partition(":")
        strategy = getattr(importlib.import_module(module), cls)
        assert issubclass(strategy, GradSync) and strategy.name == name, name
        assert strategy.from_setup.__func__ is not GradSync.from_setup.__func__, name  # built from its own needs


def test_the_config_the_reference_and_the_closed_form_read_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="parallel.dp_sync: 'sum_then_divide' is not allowed"):
        load_config(None, ["parallel.dp_sync=sum_then_divide"])
    monkeypatch.setitem(DP_STRATEGIES, "sum_then_divide", EXAMPLE)
    assert load_config(None, ["parallel.dp_sync=sum_then_divide"]).parallel.dp_sync == "sum_then_divide"
    with pytest.raises(ConfigError, match=r"^parallel.dp_sync=sum_then_divide is an example; use parallel.dp_sync="
                                          r"naive or bucketed with parallel.pp > 1$"):
        load_config(None, ["parallel.dp_sync=sum_then_divide", "parallel.pp=2", "train.batch_size=8"])
    assert "sum_then_divide" in reference_markdown()
    assert closed_form_state_bytes("sum_then_divide", 1000, 4) == 16_000  # nothing sharded: 16 bytes a parameter
    assert closed_form_state_bytes("zero2", 1000, 4) == 4000 + 12_000 / 4



def test_each_schedule_row_is_what_the_engine_and_the_simulator_read() -> None:
    for name, row in SCHEDULES.items():
        virtual = 2 if row.interleaved else 1
        plan = schedule_shape(name, 2, 4, virtual)
        assert plan.split_backward == row.split_backward and plan.stages == 2 * virtual
        assert 0 < row.bubble(2, 4, virtual) < 1


def _example_worker(info: RankInfo, runs: Path) -> None:
    DP_STRATEGIES["sum_then_divide"] = EXAMPLE  # the one row, registered where the rank builds its sync
    trainer = make_trainer(make_config(["parallel.dp=2", "parallel.dp_sync=sum_then_divide"], runs, "example"), info)
    assert isinstance(trainer.sync, SumThenDivide)
    record = {"losses": train_steps(trainer, STEPS), "params": named_params(trainer)}
    torch.save(record, runs / f"example.rank{info.rank}.pt")


@pytest.mark.slow
def test_an_example_strategy_of_one_module_and_one_row_trains_like_one_process(tmp_path: Path,
                                                                                gloo_pool: GlooPools) -> None:

    gloo_pool.run(2, _example_worker, tmp_path)
    ranks = saved_ranks(tmp_path, "example")
    ref = reference_run(make_config([], tmp_path, "example"))
    mean = [sum(losses) / len(ranks) for losses in zip(*(r["losses"] for r in ranks), strict=True)]
    assert mean == pytest.approx(ref["losses"], rel=1e-5)
    for param, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ref["params"][param], rtol=1e-4, atol=1e-4)
        assert torch.equal(value, ranks[1]["params"][param]), param
