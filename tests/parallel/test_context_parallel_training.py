"""Context parallelism through the trainer's own step on the shared gloo pool: cp=2 with each implementation (GPT-2
and Llama; the ring under block recompute and compiled blocks too; a mixture with its load-balancing loss; packed sft
rows), dp=2 x cp=2, a mixture's experts split over ep=2 inside dp=2 x cp=2, cp=2 x tp=2 (ours, with and without
sequence parallelism) and cp=2 x pp=2 (1f1b, interleaved and zb1p), and a mixture on unpacked sft rows under each of
them, train like one process on the same global batch
(losses, validation loss, every parameter, a mixture's aux_loss and expert load), and the step's point-to-point and
all-to-all bytes are their closed forms (on a tensor-parallel rank's heads, for the layers a pipeline rank holds);
with whole heads and layers, the memory record's attention bytes are their closed form, and the bytes and training
state the planner prices the same config at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
    STEPS,
    as_pipeline_chunks,
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

from gptpar.config import Config
from gptpar.parallel.comm import new_step, read_sent
from gptpar.parallel.process_group import RankInfo
from gptpar.plan.layout import layout_of
from gptpar.strategies.context_parallel import AttentionShape, attention_bytes, sent_bytes

LLAMA = ["model.preset=llama-tiny", "model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=2"]
MIXTRAL = ["model.preset=mixtral-tiny", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2",
           "model.moe_aux_loss_coef=0.1"]
QWEN_MOE = ["model.preset=qwen2-moe-tiny", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2",
            "model.moe_aux_loss_coef=0.1"]
# Packed sft rows of 24 + 23 + 1 = 48 positions (a multiple of 2 cp: one process packs the same rows) holding two to
# four short sums each (SUMS, written by the fixture), so the two shards of a micro-step hold different numbers of
# targets; two micro-steps.
SUMS = "sums.jsonl"
PAIRS = ["model.n_layer=2", "data.task=sft", "data.tokenizer=bytes", "data.max_source_len=24",
         "data.max_target_len=23", "train.grad_accum=2"]
SFT_PACKED = [*PAIRS, f"data.source=jsonl:{{runs}}/{SUMS}", "data.packing=true"]
# Unpacked rows of 48 of the same sums, every other one asked in words: a prompt of 12 bytes or more fills rank 0's
# first chunk (0-11), so its real positions end at a label in rank 1's shard; no answer reaches rank 0's second
# chunk (36-47), so rank 0's shards hold no target where every prompt is long.
WORDED = "worded_sums.jsonl"
SFT = [*PAIRS, f"data.source=jsonl:{{runs}}/{WORDED}"]
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
            ("cp2-pp2-zb1p", ["parallel.cp=2", "parallel.pp=2", "parallel.chunks=2", "parallel.pp_schedule=zb1p"]),
            # unpacked sft rows of a mixture: a shard's real positions run to its rows' last labels, wherever they
            # lie (under sp each tp rank routes half of them); under pp its chunks' target shares count each row once
            ("cp2-tp2-sp-mixtral-sft", ["parallel.cp=2", *SP, *MIXTRAL, *SFT]),
            ("cp2-pp2-mixtral-sft", ["parallel.cp=2", "parallel.pp=2", "parallel.chunks=2", *MIXTRAL, *SFT])]
RESUMED = {2: ["ring"], 4: ["cp2-tp2-sp", "cp2-pp2-ring-qwen2"]}  # by world size: runs resumed from a checkpoint
LAYERS, ROWS, SEQ, HEADS, WIDTH, FP32 = 4, 8, 16, 2, 32, 4  # BASE's model and batch


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
                  "val": trainer.evaluate(), "sent": sent, "memory": trainer.memory, "records": records}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    for name in RESUMED.get(info.world_size, []):  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(dict(CASES + COMPOSED)[name], runs, f"resumed-{name}"), info)
        torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("context_parallel")
    sums = ({"query": f"{a} + {7 * b}?", "response": f"{a + 7 * b}{'!' * (a % 9)}"}
            for a in range(30) for b in range(7))
    (runs / SUMS).write_text("".join(json.dumps(pair) + "\n" for pair in sums))
    worded = ({"query": f"what is {a} plus {7 * b}?" if a % 2 else f"{a} + {7 * b}?", "response": f"{a + 7 * b}"}
              for a in range(30) for b in range(7))
    (runs / WORDED).write_text("".join(json.dumps(pair) + "\n" for pair in worded))
    gloo_pool.run(2, _train, runs, CASES[:-WORLD_4])
    gloo_pool.run(4, _train, runs, CASES[-WORLD_4:] + COMPOSED)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides"), CASES + COMPOSED, ids=[name for name, _ in CASES + COMPOSED])
def test_context_parallel_trains_like_one_process(results: Path, name: str, overrides: list[str]) -> None:
    cfg = _config(overrides, results, name)
    p = cfg.parallel  # a mixture's micro-steps under the pipeline are its chunks (as_pipeline_chunks)
    ref = reference_run(cfg, as_pipeline_chunks(p.dp, p.chunks) if p.pp > 1 and cfg.model.shape().moe else None)
    ranks = saved_ranks(results, name)
    assert_trains_like_one_process(ref, ranks, "model.embed_tokens.weight" if any(
        arch in name for arch in ("llama", "qwen2", "mixtral", "moe")) else "transformer.wte.weight", name)
    for rank in ranks:  # a mixture's: the load-balancing loss and the experts' load over every replica's tokens
        for got, expected in zip(rank["records"] or [], ref["records"] or [], strict=True):
            assert got["aux_loss"] == pytest.approx(expected["aux_loss"], rel=1e-5)
            assert got["moe"] == expected["moe"]


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
