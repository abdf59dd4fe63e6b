"""Tensor-parallel, pipeline and expert communication priced on a finite network, against closed forms written out
by hand: a calibration that measured each collective over 2 ranks at its own latency and bandwidth (as
`gptpar plan calibrate` measures them apart), so dropping a collective, or pricing one as another, moves the price.
The collectives counted are the ones the ranks run (gptpar.parallel.tensor_parallel, gptpar.parallel.expert_parallel,
the pipeline engine's sends). Every group here has 2 ranks: an all-reduce is 2 ring steps in which a rank sends the
whole payload once, an all-gather, reduce-scatter or all-to-all 1 step sending half the tensor, a send 1 step of
all of it."""

from __future__ import annotations

import pytest
from planfix import calibration, layout

from gptpar.plan.calibration import Calibration
from gptpar.plan.layout import Layout
from gptpar.plan.network import network_of
from gptpar.plan.predict import Prediction, predict

EIGHT_BLOCKS = ("model.preset=gpt2-mini", "model.n_layer=8", "data.seq_len=64", "train.batch_size=16")
# (latency s, bandwidth B/s) of each collective, all different: a collective priced as another shows.
LINKS = {"all_reduce": (100e-6, 1e9), "reduce_scatter": (50e-6, 4e9), "all_gather": (30e-6, 2e9),
         "all_to_all": (70e-6, 0.5e9), "send_recv": (20e-6, 8e9)}


def over_two(op: str, nbytes: float) -> float:
    """Seconds of `op` of a tensor of `nbytes` over 2 ranks."""
    latency, bandwidth = LINKS[op]
    if op == "all_reduce":
        return 2 * latency + nbytes / bandwidth
    if op == "send_recv":
        return latency + nbytes / bandwidth
    return latency + nbytes / 2 / bandwidth


def finite(lay: Layout) -> Calibration:
    """planfix's calibration (each block's F, B and W 1 s, the head and optimizer free) with every collective
    measured at 4 KiB and 1 MiB on LINKS."""
    calib = calibration(lay)
    calib.collectives.update({op: [[b, over_two(op, b)] for b in (4096, 2**20)] for op in LINKS})
    return calib


def priced(lay: Layout) -> Prediction:
    calib = finite(lay)
    pred = predict(lay, calib, network_of(calib, {}, "local", on_calibrated_machine=True), "test cpu")
    if lay.pp == 1:  # on a CPU nothing overlaps: the step is its compute and every exposed collective
        assert pred.step_time_s == pytest.approx(pred.compute_s + sum(pred.exposed_comm_s.values()), rel=1e-12)
    return pred


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("lp", [False, True])
def test_tensor_parallel_communication_is_the_blocks_embedding_head_and_loss_collectives(sp: bool, lp: bool) -> None:
    lay = layout(*EIGHT_BLOCKS, "parallel.tp=2", f"parallel.sequence_parallel={sp}", f"parallel.loss_parallel={lp}")
    hidden = 16 * 64 * 256 * 4  # one micro-batch's hidden states: 16 sequences x 64 tokens x width 256 x fp32
    # Each block, forward and backward, at attention's and the MLP's input and output: without sequence parallelism
    # an all-reduce where each pair (copy, reduce) communicates, with it an all-gather and a reduce-scatter.
    pair = over_two("all_gather", hidden) + over_two("reduce_scatter", hidden) if sp else over_two("all_reduce", hidden)
    blocks = 8 * 2 * 2 * pair
    # The embedding's partial rows summed in forward (reduce-scattered into sequence shards with sp, all-gathered in
    # backward), the head's input copied (all-reduced in backward; with sp all-gathered in forward, reduce-scattered
    # in backward): the same pair each way.
    embedding_and_head = 2 * pair
    # The loss: 3 all-reduces of one fp32 number per token (max, sum of exponentials, target logit), or the logits
    # (16 x 64 tokens x 4096 vocabulary x fp32) all-gathered.
    loss = 3 * over_two("all_reduce", 16 * 64 * 4) if lp else over_two("all_gather", 16 * 64 * 4096 * 4)
    pred = priced(lay)
    assert pred.exposed_comm_s["tp"] == pytest.approx(blocks + embedding_and_head + loss, rel=1e-9)


def test_a_pipeline_sends_each_micro_batchs_activation_and_gradient_and_all_reduces_the_tied_table() -> None:
    """GPipe over 2 ranks of 4 blocks, 4 micro-batches: a rank's forward of a micro-batch takes f = 4 s and its
    backward b = 8 s (B and W of 4 blocks). Rank 1 waits for each activation (rank 0's forward and its send) and
    rank 0 for each gradient (rank 1's backward and its send), so the critical path is rank 0's 4 forwards and
    sends, rank 1's last forward, rank 1's 4 backwards and sends and rank 0's last backward:
    4 (f + send) + f + 4 (b + send) + b = 5 (f + b) + 8 sends."""
    lay = layout(*EIGHT_BLOCKS, "parallel.pp=2", "parallel.chunks=4", "parallel.pp_schedule=gpipe")
    send = over_two("send_recv", 4 * 64 * 256 * 4)  # a micro-batch of 4 sequences x 64 tokens x width 256 x fp32
    tied = over_two("all_reduce", 4096 * 256 * 4)  # GPT-2's tied table, 4096 x 256 fp32, first and last stage
    norm = over_two("all_reduce", 8)  # the gradient norm's squares summed over the stages
    pred = priced(lay)
    assert pred.exposed_comm_s["send_recv"] == pytest.approx(2 * 4 * send, rel=1e-9)  # each micro-batch both ways
    assert pred.exposed_comm_s["tied embedding all_reduce"] == pytest.approx(tied, rel=1e-9)
    assert pred.step_time_s == pytest.approx(5 * (4 + 8) + 8 * send + tied + norm, rel=1e-9)


def test_expert_parallel_all_to_alls_are_the_counts_the_picks_and_their_way_back() -> None:
    """qwen2-moe-tiny (4 mixture blocks, width 128, 8 experts, top-2) over dp = ep = 2: a block's forward exchanges
    each expert's count of picks, sends the picks to their experts and the results back; backward sends their
    gradients both ways."""
    lay = layout("model.preset=qwen2-moe-tiny", "data.seq_len=64", "train.batch_size=16", "parallel.dp=2",
                 "parallel.ep=2")
    assert (lay.shape.n_layer, lay.shape.n_embd, lay.shape.n_experts, lay.shape.top_k) == (4, 128, 8, 2)
    picks = 8 * 64 * 2 * 128 * 4  # a rank's 8 sequences x 64 tokens x top-2 x width 128 x fp32
    counts = 8 * 8  # 8 experts' counts, int64
    block = over_two("all_to_all", counts) + 2 * over_two("all_to_all", picks) + 2 * over_two("all_to_all", picks)
    assert priced(lay).exposed_comm_s["all_to_all"] == pytest.approx(4 * block, rel=1e-9)
