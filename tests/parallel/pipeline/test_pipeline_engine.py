"""The multi-process pipeline engine on real gloo groups: every schedule trains like one process.

One spawn per world size (2 and 4 ranks) runs every case through the trainer's own step (`Trainer`,
the same code `gptpar train` runs); each rank saves its losses and its parameters under their
GPT2LMHeadModel names, and the assertions here compare them with one process trained on the same
batches. Tiny model, no dropout, AdamW with clipping on, as the trainer does it; parameters agree within
1e-4 (1% of one AdamW step at lr 0.01: a missing or doubled gradient moves them by the whole step).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
    BASE,
    STEPS,
    assert_resumed_bitwise,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    saved_ranks,
    train_steps,
)
from torch import nn

from gptpar.config import ParallelConfig, load_config
from gptpar.errors import GptparError
from gptpar.models.build import build_model
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.spawn import spawn_local
from gptpar.train.checkpoint import export_checkpoint

# (case name, overrides); the world size is dp * pp.
CASES_2 = [
    ("gpipe", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.chunks=4"]),
    ("1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.chunks=4"]),
    ("interleaved", ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2",
                     "parallel.chunks=4"]),
    ("zb1p", ["parallel.pp=2", "parallel.pp_schedule=zb1p", "parallel.chunks=4"]),
    ("1f1b-accum", ["parallel.pp=2", "parallel.chunks=2", "train.grad_accum=2", "parallel.pp_split=1,3"]),
]
CASES_4 = [
    ("1f1b-p4", ["parallel.pp=4", "parallel.chunks=4", "parallel.balance=time"]),  # rank 0 times, all agree
    ("zb1p-p4", ["parallel.pp=4", "parallel.pp_schedule=zb1p", "parallel.chunks=8"]),
    ("1f1b-d2", ["parallel.pp=2", "parallel.dp=2", "parallel.chunks=2"]),
    ("zb1p-d2", ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=zb1p", "parallel.chunks=2",
                 "parallel.dp_sync=naive", "parallel.balance=params"]),
]
RESUMED = ["1f1b", "interleaved", "zb1p"]  # every way a stage's backward runs: whole, per model chunk, split


def _engine_worker(info: RankInfo, cases: list[tuple[str, list[str]]], runs: Path) -> None:
    for name, overrides in cases:
        cfg = make_config(overrides, runs, name)
        trainer = make_trainer(cfg, info)
        losses = train_steps(trainer, STEPS)
        val = trainer.evaluate()
        record = {"losses": losses, "val": val, "params": named_params(trainer), "coords": trainer.dims.coords,
                  "computes_loss": trainer.net.computes_loss, "stats": trainer.net.stats, "memory": trainer.memory}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
        if name in RESUMED:  # one step, a checkpoint, a new trainer from it, one more step
            resumed = resumed_run(make_config(overrides, runs, f"resumed-{name}"), info)
            torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("pp-engine")
    gloo_pool.run(2, _engine_worker, CASES_2, runs)
    gloo_pool.run(4, _engine_worker, CASES_4, runs)
    return runs


@pytest.mark.parametrize("name", [n for n, _ in CASES_2 + CASES_4])
@pytest.mark.slow
def test_every_schedule_trains_like_one_process(results: Path, name: str) -> None:
    overrides = dict(CASES_2 + CASES_4)[name]
    ranks = saved_ranks(results, name)
    ref = reference_run(make_config(overrides, results, name))
    dp = max(r["coords"]["dp"] for r in ranks) + 1
    for stage in {r["coords"]["pp"] for r in ranks}:  # every stage has its pipeline's loss (a replica's half)
        replicas = [r for r in ranks if r["coords"]["pp"] == stage]
        mean = [sum(losses) / dp for losses in zip(*(r["losses"] for r in replicas), strict=True)]
        assert mean == pytest.approx(ref["losses"], rel=1e-5)
        assert all(r["val"] == pytest.approx(ref["val"], rel=1e-5) for r in replicas)
    assert sum(r["computes_loss"] for r in ranks) == dp
    seen: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for param, value in rank["params"].items():
            expected = ref["params"]["transformer.wte.weight" if param == "lm_head.weight" else param]
            torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, p=param: f"{name}: {p}: {m}")
            seen[param] = value
    assert set(seen) == set(ref["params"]) | {"lm_head.weight"}  # every parameter lives on some stage
    torch.testing.assert_close(seen["lm_head.weight"], seen["transformer.wte.weight"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["1f1b", "zb1p-d2"])
@pytest.mark.slow
def test_each_stage_holds_the_training_state_of_its_own_parameters(results: Path, name: str) -> None:
    """AdamW fp32 on a stage of N_s parameters: 4 N_s + 4 N_s + 8 N_s bytes; the stages together hold the model
    once plus the LM head's copy of the tied matrix."""
    ranks = saved_ranks(results, name)
    for rank in ranks:
        n = rank["memory"]["params"]
        assert n == sum(p.numel() for p in rank["params"].values())
        assert [rank["memory"][k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")] == [4 * n, 4 * n, 8 * n]
    ref = reference_run(make_config(dict(CASES_2 + CASES_4)[name], results, name))
    one_replica = [r for r in ranks if r["coords"]["dp"] == 0]
    tied = ref["params"]["transformer.wte.weight"].numel()
    assert sum(r["memory"]["params"] for r in one_replica) == sum(p.numel() for p in ref["params"].values()) + tied


@pytest.mark.parametrize("name", ["1f1b-d2", "zb1p-d2"])
@pytest.mark.slow
def test_replicas_of_a_stage_stay_bitwise_identical(results: Path, name: str) -> None:
    ranks = saved_ranks(results, name)
    by_stage: dict[int, list[dict]] = {}
    for rank in ranks:
        by_stage.setdefault(rank["coords"]["pp"], []).append(rank["params"])
    for stage, replicas in by_stage.items():
        assert len(replicas) == 2
        for param in replicas[0]:
            assert torch.equal(replicas[0][param], replicas[1][param]), f"stage {stage}: {param}"


@pytest.mark.parametrize("name", RESUMED)
@pytest.mark.slow
def test_a_resumed_pipeline_continues_bitwise_where_it_stopped(results: Path, name: str) -> None:
    assert_resumed_bitwise(results, name)


@pytest.mark.slow
def test_each_rank_times_its_actions_and_holds_the_activations_its_schedule_allows(results: Path) -> None:
    gpipe, one_f_one_b, zb = (saved_ranks(results, n) for n in ("gpipe", "1f1b", "zb1p"))
    for ranks, kinds in ((gpipe, {"F", "B"}), (one_f_one_b, {"F", "B"}), (zb, {"F", "B", "W"})):
        for rank in ranks:
            stats = rank["stats"]
            assert {k for k, *_ in stats.spans} == kinds
            assert len([s for s in stats.spans if s[0] == "F"]) == 4  # the last step's 4 micro-batches
            assert all(0 <= a <= b <= stats.window_s for *_, a, b in stats.spans)
            assert 0 <= stats.bubble < 1
    # Rank 0 holds all 4 micro-batches under GPipe and at most P = 2 under 1F1B (and ZB-H1).
    assert gpipe[0]["stats"].peak_activation_bytes == pytest.approx(2 * one_f_one_b[0]["stats"].peak_activation_bytes)
    assert zb[0]["stats"].peak_activation_bytes == one_f_one_b[0]["stats"].peak_activation_bytes


def _raising_stage_worker(info: RankInfo, runs: Path) -> None:
    cfg = make_config(["parallel.pp=2", "parallel.chunks=2"], runs, "raising")
    trainer = make_trainer(cfg, info)
    if info.rank == 1:
        def broken(_hidden: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("stage 1 broke")
        stage: nn.Module = trainer.net.stages["1"]
        stage.forward = broken  # type: ignore[method-assign]
    train_steps(trainer, 1)


@pytest.mark.slow
def test_a_stage_that_raises_fails_the_job_in_bounded_time_naming_its_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(GptparError, match=r"^rank 1 failed: RuntimeError: stage 1 broke$"):
        spawn_local(_raising_stage_worker, 2, tmp_path, pcfg=ParallelConfig(dp=2, backend="gloo", timeout_s=60))
    assert time.monotonic() - start < 60  # a hang guard (rank 0 waits on rank 1's gradient), not a timing claim


def test_schedule_shapes_and_batches_that_do_not_fit_are_one_line_errors() -> None:
    cases = {
        ("parallel.pp=2", "parallel.chunks=3"): "train.batch_size=8 gives 8 sequences per replica and micro-step",
        ("parallel.pp=4", "parallel.chunks=2"): "parallel.chunks=2 is below parallel.pp=4",
        ("parallel.pp=2", "parallel.pp_mode=pipeline_parallel"): "parallel.pp=2 runs each stage as its own rank",
        ("parallel.pp=2", "parallel.dp_sync=ddp"): "parallel.dp_sync=ddp cannot sync a pipeline stage",
        ("parallel.pp=8", "parallel.chunks=8"): "parallel.pp * parallel.pp_virtual = 8 stages but the model has 4",
        ("parallel.pp=2", "parallel.pp_split=1,1"): "parallel.pp_split='1,1' places 2 blocks but the model has 4",
        ("parallel.pp=2", "parallel.pp_split=x"): "parallel.pp_split='x' must list 2 positive block counts",
        ("parallel.pp_virtual=2",): "parallel.pp_virtual=2 applies to the multi-process pipeline only",
    }
    for overrides, message in cases.items():
        with pytest.raises(GptparError) as caught:
            load_config(None, [*BASE, *overrides])
        assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert math.prod(grid_sizes(load_config(None, [*BASE, "parallel.pp=2", "parallel.dp=2"])).values()) == 4


@pytest.mark.slow
def test_export_writes_a_pipeline_checkpoint_as_one_gpt2_model(results: Path, tmp_path: Path) -> None:
    """`gptpar checkpoint export` of a pipeline run: every stage's tensors under GPT2LMHeadModel's names, loadable
    into one model of the tokenizer's vocabulary (the token table's padding, never trained, cut off)."""
    saved = {param: value for rank in saved_ranks(results, "resumed-1f1b") for param, value in rank["saved"].items()}
    plain = torch.load(export_checkpoint(results / "resumed-1f1b", tmp_path / "plain.pt"), weights_only=False)["gpt2"]
    model = build_model(replace(make_config([], results, "x").model, pad_vocab=1), 300, seed=0)
    assert set(plain) == set(model.state_dict())
    model.load_state_dict(plain)
    for param, value in saved.items():
        if param in ("transformer.wte.weight", "lm_head.weight"):
            assert value.shape[0] == 320 and not value[300:].any(), param
            value = value[:300]
        assert torch.equal(plain[param], value), param
