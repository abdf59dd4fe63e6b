"""Context parallelism through the trainer's own step on the shared gloo pool: cp=2 with each implementation (GPT-2
and Llama; the ring under block recompute and compiled blocks too; a mixture with its load-balancing loss; packed sft
rows), dp=2 x cp=2 and a mixture's experts split over ep=2 inside dp=2 x cp=2 train like one process on the same
global batch (losses, validation loss, every parameter, a mixture's aux_loss and expert load), and the step's
point-to-point and all-to-all bytes are their closed forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
    STEPS,
    assert_trains_like_one_process,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    saved_ranks,
    train_steps,
)

from gptpar.config import Config
from gptpar.parallel.comm import new_step, read_sent
from gptpar.parallel.process_group import RankInfo

LLAMA = ["model.preset=llama-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=2"]
MIXTRAL = ["model.preset=mixtral-tiny", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2",
           "model.moe_aux_loss_coef=0.1"]
QWEN_MOE = ["model.preset=qwen2-moe-tiny", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2",
            "model.moe_aux_loss_coef=0.1"]
# Packed sft rows of 24 + 23 + 1 = 48 positions (a multiple of 2 cp: one process packs the same rows) holding two to
# four short sums each (SUMS, written by the fixture), so the two shards of a micro-step hold different numbers of
# targets; two micro-steps.
SUMS = "sums.jsonl"
SFT_PACKED = ["model.n_layer=2", "data.task=sft", f"data.source=jsonl:{{runs}}/{SUMS}", "data.tokenizer=bytes",
              "data.max_source_len=24", "data.max_target_len=23", "data.packing=true", "train.grad_accum=2"]
CASES = [("ring", ["parallel.cp=2"]), ("ulysses-llama", ["parallel.cp=2", "parallel.cp_impl=all_to_all", *LLAMA]),
         ("ring-llama", ["parallel.cp=2", *LLAMA]),
         ("ring-recompute", ["parallel.cp=2", "train.activation_checkpointing=block"]),  # the ring again in backward
         ("ring-mixtral", ["parallel.cp=2", *MIXTRAL]),
         # dynamo runs the ring's autograd.Function and its sends between graphs (aot_eager: no C++ compiler needed)
         ("ring-compile", ["parallel.cp=2", "model.n_layer=2", "train.compile=blocks",
                           "train.compile_backend=aot_eager"]),
         ("ulysses-sft-packed", ["parallel.cp=2", "parallel.cp_impl=all_to_all", *SFT_PACKED]),
         ("dp2-cp2", ["parallel.dp=2", "parallel.cp=2"]),
         # each expert's tokens come from both replicas of its cp coordinate; its gradient is summed over cp too
         ("dp2-cp2-ep2-qwen-moe", ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", *QWEN_MOE])]
WORLD_4 = 2  # the last cases, on 4 ranks
LAYERS, ROWS, SEQ, HEADS, HEAD_DIM, FP32 = 4, 8, 16, 2, 16, 4  # BASE's model and batch


def _config(overrides: list[str], runs: Path, name: str) -> Config:
    return make_config([value.format(runs=runs) for value in overrides], runs, name)


def _train(info: RankInfo, runs: Path, cases: list[tuple[str, list[str]]]) -> None:
    """Each case of this world size: STEPS steps, the first step's bytes sent, and what assert_trains_like_one_process
    reads."""
    for name, overrides in cases:
        trainer = make_trainer(_config(overrides, runs, name), info)
        records = [] if trainer.router_load is not None else None
        new_step()
        losses = train_steps(trainer, 1, records=records)
        sent = read_sent()
        losses += train_steps(trainer, STEPS - 1, records=records)
        record = {"losses": losses, "params": named_params(trainer), "coords": dict(trainer.dims.coords),
                  "val": trainer.evaluate(), "sent": sent, "records": records}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    if info.world_size == 2:  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(dict(CASES)["ring"], runs, "resumed-ring"), info)
        torch.save(resumed, runs / f"resumed-ring.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("context_parallel")
    sums = ({"query": f"{a} + {7 * b}?", "response": f"{a + 7 * b}{'!' * (a % 9)}"}
            for a in range(30) for b in range(7))
    (runs / SUMS).write_text("".join(json.dumps(pair) + "\n" for pair in sums))
    gloo_pool.run(2, _train, runs, CASES[:-WORLD_4])
    gloo_pool.run(4, _train, runs, CASES[-WORLD_4:])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides"), CASES, ids=[name for name, _ in CASES])
def test_context_parallel_trains_like_one_process(results: Path, name: str, overrides: list[str]) -> None:
    ref = reference_run(_config(overrides, results, name))
    ranks = saved_ranks(results, name)
    assert_trains_like_one_process(ref, ranks, "model.embed_tokens.weight" if any(
        arch in name for arch in ("llama", "mixtral", "moe")) else "transformer.wte.weight", name)
    for rank in ranks:  # a mixture's: the load-balancing loss and the experts' load over every replica's tokens
        for got, expected in zip(rank["records"] or [], ref["records"] or [], strict=True):
            assert got["aux_loss"] == pytest.approx(expected["aux_loss"], rel=1e-5)
            assert got["moe"] == expected["moe"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cp", "dp"), [("ring", 2, 1), ("dp2-cp2", 2, 2), ("ulysses-llama", 2, 1)])
def test_the_step_sends_the_closed_form_of_its_exchanges(results: Path, name: str, cp: int, dp: int) -> None:
    """Per rank and layer: the ring passes K and V (each rows/dp x heads x seq/cp x head_dim) on cp - 1 times forward,
    and backward again cp - 1 times with their gradients cp times (home after the last step); all-to-all sends
    (cp - 1)/cp of q, k, v and the output (each that size) forward and their gradients backward."""
    shard = ROWS // dp * HEADS * SEQ // cp * HEAD_DIM * FP32
    expected = ({"send_recv": LAYERS * (3 * (cp - 1) + 1) * 2 * shard} if name.startswith(("ring", "dp2")) else
                {"all_to_all": LAYERS * 2 * 4 * (cp - 1) * shard // cp})
    for rank in saved_ranks(results, name):
        sent = {op: n for op, n in rank["sent"].items() if op in expected}
        assert sent == expected


@pytest.mark.slow
def test_a_resumed_cp_run_continues_bitwise(results: Path) -> None:
    """Each cp rank's checkpoint loaded back continues as the run that never stopped: its loss and parameters."""
    for straight, resumed in zip(saved_ranks(results, "ring"), saved_ranks(results, "resumed-ring"), strict=True):
        assert resumed["losses"] == [straight["losses"][1]]
        assert all(torch.equal(straight["params"][p], resumed["params"][p]) for p in straight["params"])
