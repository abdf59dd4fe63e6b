"""Context parallelism through the trainer's own step on the shared gloo pool: cp=2 with each implementation (GPT-2
and Llama; the ring under block recompute too) and dp=2 x cp=2 train like one process on the same global batch
(losses, validation loss, every parameter), and the step's point-to-point and all-to-all bytes and the memory record's
attention bytes are their closed forms, the bytes and training state the planner prices the same config at."""

from __future__ import annotations

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

from gptpar.parallel.comm import new_step, read_sent
from gptpar.parallel.process_group import RankInfo
from gptpar.plan.layout import layout_of
from gptpar.strategies.context_parallel import AttentionShape, attention_bytes, sent_bytes

LLAMA = ["model.preset=llama-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=2"]
CASES = [("ring", ["parallel.cp=2"]), ("ulysses-llama", ["parallel.cp=2", "parallel.cp_impl=all_to_all", *LLAMA]),
         ("ring-llama", ["parallel.cp=2", *LLAMA]),
         ("ring-recompute", ["parallel.cp=2", "train.activation_checkpointing=block"]),  # the ring again in backward
         ("dp2-cp2", ["parallel.dp=2", "parallel.cp=2"])]
LAYERS, ROWS, SEQ, HEADS, HEAD_DIM, FP32 = 4, 8, 16, 2, 16, 4  # BASE's model and batch


def _train(info: RankInfo, runs: Path, cases: list[tuple[str, list[str]]]) -> None:
    """Each case of this world size: STEPS steps, the first step's bytes sent, and what assert_trains_like_one_process
    reads."""
    for name, overrides in cases:
        trainer = make_trainer(make_config(overrides, runs, name), info)
        new_step()
        losses = train_steps(trainer, 1)
        sent = read_sent()
        losses += train_steps(trainer, STEPS - 1)
        record = {"losses": losses, "params": named_params(trainer), "coords": dict(trainer.dims.coords),
                  "val": trainer.evaluate(), "sent": sent, "memory": trainer.memory}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    if info.world_size == 2:  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(dict(CASES)["ring"], runs, "resumed-ring"), info)
        torch.save(resumed, runs / f"resumed-ring.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("context_parallel")
    gloo_pool.run(2, _train, runs, CASES[:-1])
    gloo_pool.run(4, _train, runs, CASES[-1:])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides"), CASES, ids=[name for name, _ in CASES])
def test_context_parallel_trains_like_one_process(results: Path, name: str, overrides: list[str]) -> None:
    ref = reference_run(make_config(overrides, results, name))
    assert_trains_like_one_process(ref, saved_ranks(results, name), "transformer.wte.weight"
                                   if "llama" not in name else "model.embed_tokens.weight", name)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cp", "dp"), [("ring", 2, 1), ("dp2-cp2", 2, 2), ("ulysses-llama", 2, 1)])
def test_the_step_sends_the_closed_form_of_its_exchanges(results: Path, name: str, cp: int, dp: int) -> None:
    """Per rank and layer: the ring passes K and V (each rows/dp x heads x seq/cp x head_dim) on cp - 1 times forward,
    and backward again cp - 1 times with their gradients cp times (home after the last step); all-to-all sends
    (cp - 1)/cp of q, k, v and the output (each that size) forward and their gradients backward."""
    shard = ROWS // dp * HEADS * SEQ // cp * HEAD_DIM * FP32
    expected = ({"send_recv": LAYERS * (3 * (cp - 1) + 1) * 2 * shard} if name.startswith(("ring", "dp2")) else
                {"all_to_all": LAYERS * 2 * 4 * (cp - 1) * shard // cp})
    impl = "ring" if "send_recv" in expected else "all_to_all"
    attention = AttentionShape(LAYERS, HEADS, HEADS, HEAD_DIM, ROWS // dp, SEQ)
    planned = layout_of(make_config(dict(CASES)[name], results, name))  # the planner's layout of the run's config
    assert sent_bytes(impl, cp, attention) == expected
    assert sent_bytes(planned.cp_impl, planned.cp, planned.attention(FP32)) == expected
    params = planned.rank_parameters(0)  # the planner's training state: whole gradients, nothing sharded over dp x cp
    for rank in saved_ranks(results, name):
        sent = {op: n for op, n in rank["sent"].items() if op in expected}
        assert sent == expected
        memory = rank["memory"]
        assert memory["attention_bytes"] == attention_bytes(impl, cp, attention)  # the memory record's
        assert (memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]) == (4 * params, 4 * params,
                                                                                               8 * params)


@pytest.mark.slow
def test_under_recompute_the_memory_record_counts_no_attention_bytes(results: Path) -> None:
    """A recomputed block's attention saves nothing for backward (its hooks are checkpoint's, not a counter's)."""
    assert all("attention_bytes" not in rank["memory"] for rank in saved_ranks(results, "ring-recompute"))


@pytest.mark.slow
def test_a_resumed_cp_run_continues_bitwise(results: Path) -> None:
    """Each cp rank's checkpoint loaded back continues as the run that never stopped: its loss and parameters."""
    for straight, resumed in zip(saved_ranks(results, "ring"), saved_ranks(results, "resumed-ring"), strict=True):
        assert resumed["losses"] == [straight["losses"][1]]
        assert all(torch.equal(straight["params"][p], resumed["params"][p]) for p in straight["params"])
