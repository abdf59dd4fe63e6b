"""Context parallelism through the trainer's own step on the shared gloo pool: cp=2 with each implementation (GPT-2
and Llama; the ring under block recompute too), dp=2 x cp=2, cp=2 x tp=2 (ours, with and without sequence
parallelism) and cp=2 x pp=2 (1f1b, interleaved and zb1p) train like one process on the same global batch (losses,
validation loss, every parameter), and the step's point-to-point and all-to-all bytes are their closed forms (on a
tensor-parallel rank's heads, for the layers a pipeline rank holds); with whole heads and layers, the memory record's
attention bytes are their closed form, and the bytes and training state the planner prices the same config at."""

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

from gptpar.parallel.comm import new_step, read_sent
from gptpar.parallel.process_group import RankInfo
from gptpar.plan.layout import layout_of
from gptpar.strategies.context_parallel import AttentionShape, attention_bytes, sent_bytes

LLAMA = ["model.preset=llama-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=2"]
CASES = [("ring", ["parallel.cp=2"]), ("ulysses-llama", ["parallel.cp=2", "parallel.cp_impl=all_to_all", *LLAMA]),
         ("ring-llama", ["parallel.cp=2", *LLAMA]),
         ("ring-recompute", ["parallel.cp=2", "train.activation_checkpointing=block"]),  # the ring again in backward
         ("dp2-cp2", ["parallel.dp=2", "parallel.cp=2"])]
# cp composed with our tensor parallelism (with sequence parallelism: each cp shard split again over tp) and the
# multi-process pipeline (each stage's attention over the cp group, the cp shard between stages), one short run each.
GQA = ["model.n_head=4", "model.n_kv_head=2"]  # all_to_all under tp=2 trades 4 / 2 = 2 heads per rank over cp=2
QWEN2 = ["model.preset=qwen2-tiny", "model.n_layer=4", "model.n_embd=32", *GQA]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
COMPOSED = [("cp2-tp2", ["parallel.cp=2", "parallel.tp=2", "parallel.loss_parallel=true"]),  # loss on vocab shards
            ("cp2-tp2-sp", ["parallel.cp=2", *SP]),
            ("cp2-tp2-sp-ulysses-llama", ["parallel.cp=2", "parallel.cp_impl=all_to_all", *SP, *LLAMA, *GQA]),
            ("cp2-pp2-ring-qwen2", ["parallel.cp=2", "parallel.pp=2", "parallel.chunks=2", *QWEN2]),
            ("cp2-pp2-ulysses", ["parallel.cp=2", "parallel.pp=2", "parallel.chunks=2", "parallel.cp_impl=all_to_all",
                                 "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"]),
            ("cp2-pp2-zb1p", ["parallel.cp=2", "parallel.pp=2", "parallel.chunks=2", "parallel.pp_schedule=zb1p"])]
RESUMED = {2: ["ring"], 4: ["cp2-tp2-sp", "cp2-pp2-ring-qwen2"]}  # by world size: runs resumed from a checkpoint
LAYERS, ROWS, SEQ, HEADS, WIDTH, FP32 = 4, 8, 16, 2, 32, 4  # BASE's model and batch


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
    for name in RESUMED.get(info.world_size, []):  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(dict(CASES + COMPOSED)[name], runs, f"resumed-{name}"), info)
        torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("context_parallel")
    gloo_pool.run(2, _train, runs, CASES[:-1])
    gloo_pool.run(4, _train, runs, CASES[-1:] + COMPOSED)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides"), CASES + COMPOSED, ids=[name for name, _ in CASES + COMPOSED])
def test_context_parallel_trains_like_one_process(results: Path, name: str, overrides: list[str]) -> None:
    ref = reference_run(make_config(overrides, results, name))
    gpt2 = "llama" not in name and "qwen2" not in name
    assert_trains_like_one_process(ref, saved_ranks(results, name), "transformer.wte.weight" if gpt2 else
                                   "model.embed_tokens.weight", name)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dp", "tp", "pp", "heads", "kv_heads"), [
    ("ring", 1, 1, 1, HEADS, HEADS), ("dp2-cp2", 2, 1, 1, HEADS, HEADS), ("ulysses-llama", 1, 1, 1, HEADS, HEADS),
    ("cp2-tp2", 1, 2, 1, HEADS, HEADS), ("cp2-tp2-sp-ulysses-llama", 1, 2, 1, 4, 2),
    ("cp2-pp2-ring-qwen2", 1, 1, 2, 4, 2)])
def test_the_step_sends_the_closed_form_of_its_exchanges(results: Path, name: str, dp: int, tp: int, pp: int,
                                                          heads: int, kv_heads: int) -> None:
    """Per rank and layer it holds (LAYERS / pp): the ring passes K and V (each rows/dp x kv_heads/tp x seq/cp x
    head_dim: a tensor-parallel rank's key/value heads) on cp - 1 times forward, and backward again cp - 1 times with
    their gradients cp times (home after the last step); all-to-all sends (cp - 1)/cp of q, k, v and the output
    (each rows/dp x heads/tp x seq/cp x head_dim, k and v repeated to the query heads) forward and their gradients
    backward."""
    cp, layers, head_dim = 2, LAYERS // pp, WIDTH // heads
    shard = ROWS // dp * SEQ // cp * head_dim * FP32
    expected = ({"send_recv": layers * (3 * (cp - 1) + 1) * 2 * shard * kv_heads // tp} if "ulysses" not in name else
                {"all_to_all": layers * 2 * 4 * (cp - 1) * shard * heads // tp // cp})
    for rank in saved_ranks(results, name):
        sent = {op: n for op, n in rank["sent"].items() if op in expected}
        assert sent == expected
    if tp == pp == 1:  # whole heads and layers: the memory record's attention bytes, the planner's bytes and state
        impl = "all_to_all" if "ulysses" in name else "ring"
        attention = AttentionShape(LAYERS, HEADS, HEADS, WIDTH // HEADS, ROWS // dp, SEQ)
        planned = layout_of(make_config(dict(CASES)[name], results, name))  # the planner's layout of the run's config
        assert sent_bytes(impl, cp, attention) == expected
        assert sent_bytes(planned.cp_impl, planned.cp, planned.attention(FP32)) == expected
        params = planned.rank_parameters(0)  # the planner's training state: whole gradients, nothing sharded
        for rank in saved_ranks(results, name):
            memory = rank["memory"]
            assert memory["attention_bytes"] == attention_bytes(impl, cp, attention)  # the memory record's
            assert (memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]) == (
                4 * params, 4 * params, 8 * params)


@pytest.mark.slow
def test_under_recompute_the_memory_record_counts_no_attention_bytes(results: Path) -> None:
    """A recomputed block's attention saves nothing for backward (its hooks are checkpoint's, not a counter's)."""
    assert all("attention_bytes" not in rank["memory"] for rank in saved_ranks(results, "ring-recompute"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for names in RESUMED.values() for name in names])
def test_a_resumed_cp_run_continues_bitwise(results: Path, name: str) -> None:
    """Each rank's checkpoint (cp ranks holding the same tensor-parallel pieces or pipeline stage) loaded back
    continues as the run that never stopped: its loss and parameters."""
    assert_resumed_bitwise(results, name)
