"""A LoRA run (train.lora_rank > 0) priced as what trains: gptpar/adapters.py's closed form of the trainable
parameters against the real model peft adapts on the meta device, for every family and several target lists; the
training state, the data-parallel syncs and the blocks' weight gradients over the adapters only, on planfix's
synthetic calibrations; and a target the closed form cannot count priced as full training, with the note."""

from __future__ import annotations

import dataclasses

import pytest
from planfix import FREE, calibration, layout, network

from gptpar.adapters import Trainable, lora_targets, lora_trainable
from gptpar.config import ModelConfig, TrainConfig
from gptpar.errors import GptparError
from gptpar.models.build import empty_model, model_config, pad_config
from gptpar.models.lora import inject_lora, trainable_count
from gptpar.plan.predict import predict
from gptpar.strategies.data_parallel import DP_STRATEGIES

RANK = 4
VOCAB = 64  # a multiple of model.pad_vocab: the LM head is a Linear that peft can adapt


def _real(preset: str, targets: str, vocab: int = VOCAB, multiple: int = 0) -> tuple[int, int]:
    """`trainable_count` and the trainable tensors (what naive reduces one by one) of the preset's model on the meta
    device with adapters of RANK on `targets` (its table padded to a `multiple` of rows where given, as
    model.pad_vocab pads it)."""
    config = model_config(ModelConfig(preset=preset), vocab)
    model = empty_model(pad_config(config, multiple) if multiple else config)
    inject_lora(model, TrainConfig(lora_rank=RANK, lora_targets=targets))
    return trainable_count(model), sum(p.requires_grad for p in model.parameters())


def _closed(preset: str, targets: str, vocab: int = VOCAB, head: bool = True) -> Trainable | list[str]:
    shape = ModelConfig(preset=preset).shape()
    return lora_trainable(shape, vocab, RANK, lora_targets(shape.arch, targets), head)


@pytest.mark.parametrize(("preset", "targets"), [
    ("gpt2-tiny", ""),  # the row's attn.c_attn and attn.c_proj
    ("gpt2-tiny", "c_proj"),  # attn.c_proj and mlp.c_proj
    ("gpt2-tiny", "attn.c_proj"),  # one of them
    ("gpt2-tiny", "mlp.c_fc,mlp.c_proj"),
    ("gpt2-tiny", "wte,wpe,lm_head"),  # the tables (embeddings) and the tied head's own Linear
    ("gpt2-tiny", "h.0.attn.c_attn,c_attn"),  # one block's layer by its full tail, and each layer once
    ("llama-tiny", ""),  # q, k, v, o (k and v narrower: 2 KV heads)
    ("llama-tiny", "gate_proj,up_proj,down_proj"),
    ("llama-tiny", "embed_tokens,lm_head"),
    ("qwen2-tiny", "mlp.down_proj,o_proj"),
    ("mixtral-tiny", ""),
    ("mixtral-tiny", "lm_head"),
    ("qwen2-moe-tiny", ""),
    ("qwen2-moe-tiny", "shared_expert.gate_proj,shared_expert_gate"),
    ("vit-tiny", ""),  # q, k, v, o and the classifier whole (lora_trained)
    ("vit-tiny", "projection,fc1"),  # the patch projection's convolution
    ("vit-tiny", "classifier"),  # adapters on the classifier that also trains whole
])
def test_the_closed_form_is_the_count_of_the_model_peft_adapts(preset: str, targets: str) -> None:
    closed = _closed(preset, targets)
    assert isinstance(closed, Trainable), closed
    assert (closed.total, closed.tensors) == _real(preset, targets)


def test_a_block_counts_rank_times_in_plus_out_per_adapted_layer() -> None:
    """By hand: gpt2-tiny (4 blocks, width 128) on attn.c_attn (128 -> 384) and attn.c_proj (128 -> 128); each A and
    B a tensor."""
    closed = _closed("gpt2-tiny", "")
    assert (closed.first, closed.blocks, closed.last, closed.tensors) == (0, 4 * RANK * (512 + 256), 0, 4 * 2 * 2)


@pytest.mark.parametrize(("preset", "targets", "multiple", "unknown"), [
    ("mixtral-tiny", "q_proj,experts", 0, ["experts"]),  # a mixture's fused experts: no layer
    ("qwen2-tiny", "proj", 0, ["proj"]),  # no module's name ends with ".proj"
    ("llama-tiny", "lm_head", 128, ["lm_head"]),  # a padded table's head is gptpar's PaddedHead, no Linear
])
def test_a_target_the_closed_form_does_not_count_is_one_the_run_refuses(preset: str, targets: str, multiple: int,
                                                                         unknown: list[str]) -> None:
    assert _closed(preset, targets, VOCAB, head=not multiple) == unknown
    with pytest.raises(GptparError, match="train.lora_targets"):
        _real(preset, targets, VOCAB, multiple)


EIGHT_BLOCKS = ("model.preset=gpt2-mini", "model.n_layer=8", "data.seq_len=64", "train.batch_size=16")
LORA = ("train.lora_rank=8",)
# gpt2-mini (width 256) on attn.c_attn (256 -> 768) and attn.c_proj (256 -> 256): 8 (1024 + 512) per block
ADAPTERS = 8 * 8 * (1024 + 512)


@pytest.mark.parametrize(("sync", "offload"), [("bucketed", "none"), ("zero2", "none"), ("zero2", "optimizer"),
                                               ("fsdp2", "none")])
def test_the_training_state_is_the_strategy_closed_form_over_the_adapters(sync: str, offload: str) -> None:
    lay = layout(*EIGHT_BLOCKS, *LORA, "parallel.dp=2", f"parallel.dp_sync={sync}", f"parallel.offload={offload}")
    assert lay.trainable(0) == ADAPTERS
    n, row = lay.rank_parameters(0), DP_STRATEGIES[sync]
    memory = predict(lay, calibration(lay), network(), "test cpu").memory
    device, host = row.placed_bytes(n, 2, offload, trainable=ADAPTERS)
    assert (memory["state"], memory["host"]) == (int(device), int(host))
    assert memory["state"] + memory["host"] == pytest.approx(row.state_bytes(n, 2, offload, trainable=ADAPTERS))
    assert memory["grads"] == 4 * ADAPTERS // (2 if "grads" in row.sharded else 1)


def test_the_syncs_carry_the_adapters_gradients_only() -> None:
    """On a CPU (nothing overlaps), 1e8 bytes/s: naive all-reduces each of the 8 x 2 x 2 adapter tensors (2 steps of
    1 ms each over 2 ranks), bucketed the adapters' bytes once, zero2 reduce-scatters them in each of 2 micro-steps
    and gathers the updated shards (half the bytes each over 2 ranks); fsdp2 still gathers every weight (the root
    once, each block in forward and again in backward) but reduce-scatters the adapters' gradients alone."""
    latency, bandwidth = 1e-3, 1e8
    naive = layout(*EIGHT_BLOCKS, *LORA, "parallel.dp=2", "parallel.dp_sync=naive")
    pred = predict(naive, calibration(naive), network(latency, bandwidth), "test cpu")
    assert pred.exposed_comm_s["all_reduce"] == pytest.approx(32 * 2 * latency + ADAPTERS * 4 / bandwidth)
    net = network(0.0, bandwidth)
    bucketed = layout(*EIGHT_BLOCKS, *LORA, "parallel.dp=2", "parallel.dp_sync=bucketed")
    pred = predict(bucketed, calibration(bucketed), net, "test cpu")
    assert pred.exposed_comm_s["all_reduce"] == pytest.approx(ADAPTERS * 4 / bandwidth)
    zero2 = layout(*EIGHT_BLOCKS, *LORA, "parallel.dp=2", "parallel.dp_sync=zero2", "train.grad_accum=2")
    pred = predict(zero2, calibration(zero2), net, "test cpu")
    assert pred.exposed_comm_s["reduce_scatter"] == pytest.approx(2 * ADAPTERS * 4 / 2 / bandwidth)
    assert pred.exposed_comm_s["all_gather"] == pytest.approx(ADAPTERS * 4 / 2 / bandwidth)
    fsdp2 = layout(*EIGHT_BLOCKS, *LORA, "parallel.dp=2", "parallel.dp_sync=fsdp2")
    pred = predict(fsdp2, calibration(fsdp2), net, "test cpu")
    gathered = fsdp2.end_parameters(0) + 2 * 8 * fsdp2.block_parameters
    assert pred.exposed_comm_s["fsdp gathers and reduce-scatters"] == pytest.approx(
        (gathered + ADAPTERS) * 4 / 2 / bandwidth)


def test_a_frozen_weight_gets_no_weight_gradient() -> None:
    """F and B free, a block's full W 1 s: a LoRA block's W is its adapters' share of its weights (12,288 of gpt2-mini's
    12 d^2 + 13 d = 789,760), 8 blocks of it; the frozen LM head's backward is its input gradient alone, half the
    full head's (head_bw at 1e9 FLOPs/s)."""
    full, lora = layout(*EIGHT_BLOCKS), layout(*EIGHT_BLOCKS, *LORA)
    calib = calibration(full)
    calib = dataclasses.replace(calib, compute=calib.compute | {"block_f": FREE, "block_b": FREE})
    assert predict(full, calib, network(), "test cpu").compute_s == pytest.approx(8.0)  # the head free
    assert predict(lora, calib, network(), "test cpu").compute_s == pytest.approx(8 * 12_288 / 789_760)
    calib = dataclasses.replace(calib, compute=calib.compute | {"head_bw": [[1e9, 1.0]]})
    hf = 2.0 * full.tokens * 256 * full.vocab
    assert predict(full, calib, network(), "test cpu").compute_s == pytest.approx(8.0 + 2 * hf / 1e9)
    assert predict(lora, calib, network(), "test cpu").compute_s == pytest.approx(8 * 12_288 / 789_760 + hf / 1e9)


@pytest.mark.parametrize(("sync", "offload", "per_step", "per_micro"), [
    ("zero2", "optimizer", 2, 0),  # the gradient shard down and the updated shard up, once a step
    ("fsdp2", "params", 1, 2),  # the gradient shard down once; every weight's shard up for each micro-step's 2 gathers
])
def test_the_optimizer_steps_the_adapters_and_offload_copies_their_state(sync: str, offload: str, per_step: int,
                                                                         per_micro: int) -> None:
    """Blocks free, the optimizer 1e6 parameters/s over its shard of 2, the host link HOST_DEVICE's 25 GB/s: what the
    optimizer step copies is the adapters' shard, what forward and backward gather is every weight's."""
    lay = layout(*EIGHT_BLOCKS, *LORA, "parallel.dp=2", f"parallel.dp_sync={sync}", f"parallel.offload={offload}",
                 "train.grad_accum=2")
    calib = calibration(lay)
    calib = dataclasses.replace(calib, compute=calib.compute | {"block_f": FREE, "block_b": FREE, "block_w": FREE,
                                                                "optimizer": [[1e6, 1.0]]})
    pred = predict(lay, calib, network(), "test cpu")
    assert pred.compute_s == pytest.approx(ADAPTERS / 2 / 1e6)
    copies = 4 * (ADAPTERS * per_step + lay.rank_parameters(0) * per_micro * 2) / 2
    assert pred.exposed_comm_s["host-device copies"] == pytest.approx(copies / 25e9)


def test_a_counted_lora_run_says_only_its_activations_are_an_upper_bound() -> None:
    pred = predict(lay := layout(*EIGHT_BLOCKS, *LORA), calibration(lay), network(), "test cpu")
    assert pred.notes == [f"train.lora_rank=8: {ADAPTERS:,} parameters train (gptpar/adapters.py), their gradients, "
                          "optimizer state and sync alone priced; the activations are full training's calibrated "
                          "figure (a frozen layer may save less): an upper bound"]


def test_a_target_the_closed_form_cannot_count_is_priced_as_full_training_and_says_so() -> None:
    """A mixture's experts (peft cannot adapt them, so the run stops at build): the planner does not crash, it prices
    full training and says why its figures are upper bounds."""
    words = ("model.preset=mixtral-tiny", "data.seq_len=64", "train.batch_size=4", "parallel.dp=2")
    full, lora = layout(*words), layout(*words, "train.lora_rank=8", "train.lora_targets=q_proj,experts")
    assert (lora.lora, lora.lora_unknown) == (None, ("experts",))
    calib = calibration(full)
    plain, adapted = (predict(lay, calib, network(), "test cpu") for lay in (full, lora))
    assert (adapted.step_time_s, adapted.memory_bytes) == (plain.step_time_s, plain.memory_bytes)
    assert any(note.startswith("train.lora_rank=8 is priced as full training") and "experts names no layer" in note
               and note.endswith("upper bounds") for note in adapted.notes), adapted.notes
