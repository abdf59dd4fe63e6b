"""The cost model's arithmetic against hand-computed values on synthetic calibrations: the pipeline's bubble is the
closed form under unit costs, naive exposes every all-reduce, bucketed hides what backward covers on a GPU (nothing
on a CPU, whose cores do both), memory is the
strategy table's closed form plus the activations each schedule holds; parallel.offload's copies are its row's bytes
over the host-device link."""

from __future__ import annotations

import dataclasses

import pytest
from planfix import calibration, layout, network

from gptpar.plan.calibration import RECOMPUTED, Calibration, LinkFit, cp_kind, tp_kind
from gptpar.plan.layout import Layout, block_flops, head_flops
from gptpar.plan.network import Network, network_of
from gptpar.plan.predict import CP_LABEL, predict
from gptpar.strategies.context_parallel import exchange, sent_bytes
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.strategies.pipeline import closed_form_bubble, schedule, simulate

EIGHT_BLOCKS = ("model.preset=gpt2-mini", "model.n_layer=8", "data.seq_len=64", "train.batch_size=16")


@pytest.mark.parametrize(("schedule", "pp", "chunks", "virtual"), [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1), ("zb1p", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2)])
def test_the_pipeline_bubble_is_the_closed_form_under_unit_costs(schedule: str, pp: int, chunks: int,
                                                                 virtual: int) -> None:
    lay = layout(*EIGHT_BLOCKS, f"parallel.pp={pp}", f"parallel.chunks={chunks}", f"parallel.pp_schedule={schedule}",
                 f"parallel.pp_virtual={virtual}")
    pred = predict(lay, calibration(lay), network(), "test cpu")
    assert pred.bubble_s / pred.step_time_s == pytest.approx(closed_form_bubble(schedule, pp, chunks, virtual))
    blocks = 8 // pp
    assert pred.compute_s == pytest.approx(chunks * blocks * 3)  # every rank's F + B + W of its blocks, per micro-batch


def test_naive_exposes_every_all_reduce_and_bucketed_hides_what_backward_covers() -> None:
    words = (*EIGHT_BLOCKS, "parallel.dp=2", "parallel.bucket_mb=0.001")
    latency, bandwidth = 1e-3, 1e8
    net = network(latency, bandwidth)
    naive = layout(*words, "parallel.dp_sync=naive")
    n = naive.rank_parameters(0)
    pred = predict(naive, calibration(naive), net, "test cpu")
    tensors = 8 * 12 + 4  # GPT-2's 12 tensors per block; the token and position tables, the final norm's two
    # An all-reduce over 2 ranks sends its whole payload once (2(g-1)/g) in 2(g-1) = 2 steps.
    assert pred.exposed_comm_s["all_reduce"] == pytest.approx(tensors * 2 * latency + n * 4 / bandwidth)
    assert pred.compute_s == pytest.approx(8 * 3)  # 8 blocks x (F + B + W), one micro-step
    assert pred.step_time_s == pytest.approx(pred.compute_s + pred.exposed_comm_s["all_reduce"]
                                             + pred.exposed_comm_s["small"])

    bucketed = layout(*words, "parallel.dp_sync=bucketed")
    fast = network(0.0, bandwidth)
    on_cpu = predict(bucketed, calibration(bucketed), fast, "test cpu")
    # On a CPU gloo's threads sum on the cores that compute: every bucket's time is the step's.
    assert on_cpu.exposed_comm_s["all_reduce"] == pytest.approx(n * 4 / bandwidth)
    gpu = calibration(bucketed, device="cuda", device_name="TestGPU")
    pred = predict(bucketed, gpu, fast, "TestGPU")
    # Each block is a bucket reduced (in block / bandwidth << one block's backward) while the next block's backward
    # runs; the first block's bucket and the tables' complete only at backward's end: those two are exposed.
    block = bucketed.block_parameters * 4 / bandwidth
    tables = (bucketed.end_parameters(0) - bucketed.shape.norm_parameters()) * 4 / bandwidth
    assert pred.exposed_comm_s["all_reduce"] == pytest.approx(block + tables)
    slow = predict(bucketed, gpu, network(0.0, bandwidth / 1000), "TestGPU")
    whole = n * 4 / (bandwidth / 1000)  # every bucket's time, far longer than backward: all but backward exposed
    assert whole - 8 * 2 <= slow.exposed_comm_s["all_reduce"] <= whole


def test_zero2_reduces_every_micro_step_and_gathers_after_the_step() -> None:
    lay = layout(*EIGHT_BLOCKS, "parallel.dp=2", "parallel.dp_sync=zero2", "train.grad_accum=2",
                 "parallel.bucket_mb=1000")
    bandwidth = 1e8
    pred = predict(lay, calibration(lay), network(0.0, bandwidth), "test cpu")
    n = lay.rank_parameters(0)
    # one bucket, ready at backward's end: its reduce-scatter (half the bytes of an all-reduce) exposed per micro-step
    assert pred.exposed_comm_s["reduce_scatter"] == pytest.approx(2 * n * 4 / 2 / bandwidth)
    assert pred.exposed_comm_s["all_gather"] == pytest.approx(n * 4 / 2 / bandwidth)


@pytest.mark.parametrize("sync", ["bucketed", "zero1", "zero2", "fsdp"])
def test_memory_is_the_strategy_closed_form_plus_activations(sync: str) -> None:
    lay = layout(*EIGHT_BLOCKS, "parallel.dp=2", f"parallel.dp_sync={sync}")
    calib = calibration(lay, activation=100.0)
    pred = predict(lay, calib, network(), "test cpu")
    n = lay.rank_parameters(0)
    assert pred.memory["state"] == int(DP_STRATEGIES[sync].state_bytes(n, 2))
    tokens, d = 8 * 64, 256
    assert pred.memory["activations"] == int(8 * tokens * 100.0 * d + tokens * 4096 * 4)  # blocks, then fp32 logits
    gathered = 4 * (2 * lay.end_parameters(0) + 4 * lay.block_parameters) if sync == "fsdp" else 0
    assert pred.memory_bytes == pred.memory["state"] + pred.memory["activations"] + gathered


@pytest.mark.parametrize(("words", "roots", "blocks", "whole"), [
    (("parallel.dp=2",), 2, 4, 0),  # root parameters and gradients; a block's, the prefetch, a reduce-scatter input
    (("parallel.dp=2", "parallel.offload=params"), 2, 4, 0),  # the host's shards copied in: the same units
    (("parallel.dp=1", "parallel.offload=params"), 2, 3, 0),  # a group of one: no all-gather output, no prefetch
    (("parallel.dp=1",), 0, 0, 0),  # no sync: the plain model, its whole state counted as state
    # accumulating: every unit's whole gradient, and the root's parameters, its kept all-gather output and block 0's
    # (2 + 1; a root unit of gpt2-mini outweighs a block), else the root's parameters and (1 + 1) a block's alone
    (("parallel.dp=2", "train.grad_accum=2"), 2, 1, 1),
    (("parallel.dp=1", "parallel.offload=params", "train.grad_accum=2"), 1, 1, 1),
], ids=["dp2", "dp2-offload", "dp1-offload", "dp1", "dp2-accum", "dp1-offload-accum"])
def test_fsdp2_holds_its_unsharded_units_wherever_its_sync_runs(words: tuple[str, ...], roots: int, blocks: int,
                                                                whole: int) -> None:
    """memory["gathered"]: 4 bytes a parameter of what torch's fully_shard holds unsharded at once (its row's
    in_flight, measured by tests/parallel/data_parallel/test_zero.py), over dp=2 and over a group of one under
    parallel.offload=params, part of the device's total."""
    lay = layout(*EIGHT_BLOCKS, "parallel.dp_sync=fsdp2", *words)
    pred = predict(lay, calibration(lay), network(), "test cpu")
    root, block = lay.end_parameters(0), lay.block_parameters
    assert root > block
    assert pred.memory["gathered"] == 4 * (roots * root + blocks * block + whole * lay.rank_parameters(0))
    assert pred.memory_bytes == pred.memory["state"] + pred.memory["activations"] + pred.memory["gathered"]


def test_a_pipeline_holds_the_activations_its_schedule_keeps() -> None:
    lay = layout(*EIGHT_BLOCKS, "parallel.pp=4", "parallel.chunks=8", "parallel.pp_schedule=1f1b")
    gpipe = layout(*EIGHT_BLOCKS, "parallel.pp=4", "parallel.chunks=8", "parallel.pp_schedule=gpipe")
    per_micro_batch = 2 * 2 * 64 * 100.0 * 256  # 2 blocks x 2 sequences of 64 tokens x 100 B per token and width
    one = predict(lay, calibration(lay), network(), "test cpu")
    assert one.memory["activations"] == int(4 * per_micro_batch)  # rank 0 of 1F1B holds P micro-batches
    all_of_them = predict(gpipe, calibration(gpipe), network(), "test cpu")
    logits = 2 * 64 * 4096 * 4  # the last rank's fp32 logits of each micro-batch
    assert all_of_them.memory["activations"] == int(8 * (per_micro_batch + logits))  # GPipe holds every one


def test_recomputed_blocks_keep_only_their_input_and_run_forward_twice() -> None:
    lay = layout(*EIGHT_BLOCKS, "train.activation_checkpointing=block")
    pred = predict(lay, calibration(lay), network(), "test cpu")
    tokens = 16 * 64
    assert pred.memory["activations"] == tokens * 256 * 4 * 8 + tokens * 4096 * 4
    assert pred.compute_s == pytest.approx(8 * 4)  # F, B, W and the recomputed F of each block
    # Where the calibration timed a checkpointed block whole (its forward through checkpoint's hooks, its backward
    # with the recompute inside), every fourth block costs those: 2 + 5 + 1 s against the others' 3 s.
    every_fourth = layout(*EIGHT_BLOCKS, "train.activation_checkpointing=4")
    calib = calibration(every_fourth)
    flops = block_flops(every_fourth.shape, every_fourth.tokens, every_fourth.seq_len)
    calib.compute.update({k: [[x, t]] for k, x, t in zip(RECOMPUTED, flops, (2.0, 5.0, 1.0), strict=True)})
    assert predict(every_fourth, calib, network(), "test cpu").compute_s == pytest.approx(6 * 3 + 2 * 8)


def test_fsdp_hides_every_gather_but_the_first_of_each_pass_behind_compute() -> None:
    lay = layout(*EIGHT_BLOCKS, "parallel.dp=2", "parallel.dp_sync=fsdp")
    bandwidth = 1e9
    root, block = lay.end_parameters(0) * 4, lay.block_parameters * 4  # a unit's bytes; a rank sends half over 2
    fsdp = "fsdp gathers and reduce-scatters"
    # Blocks of 1 s hide every prefetched gather and every reduce-scatter but the last ones: exposed are the root's and
    # block 0's gathers in forward, the last block's gather in backward, and block 0's and the root's reduce-scatters.
    gpu = {"device": "cuda", "device_name": "TestGPU"}
    slow_compute = predict(lay, calibration(lay, **gpu), network(0.0, bandwidth), "TestGPU")
    assert slow_compute.exposed_comm_s[fsdp] == pytest.approx((root + 1.5 * block) / bandwidth)
    # Blocks that cost nothing hide nothing: every unit's collectives, one after another; on a CPU (gloo's threads
    # on the computing cores) none is hidden however long the blocks take.
    free = predict(lay, calibration(lay, 1e-12, 1e-12, 1e-12, **gpu), network(0.0, bandwidth), "TestGPU")
    assert free.exposed_comm_s[fsdp] == pytest.approx((root + 12 * block) / bandwidth, rel=1e-6)
    on_cpu = predict(lay, calibration(lay), network(0.0, bandwidth), "test cpu")
    assert on_cpu.exposed_comm_s[fsdp] == pytest.approx((root + 12 * block) / bandwidth, rel=1e-6)


def test_a_tensor_parallel_block_timed_whole_is_priced_as_timed() -> None:
    """A calibration that timed the tp=2 block whole (collectives inside) prices it so: 2 s each of F, B and W
    against the whole block's 1 s scaled by its FLOPs, and its head and loss so; a layout it did not time (sequence
    parallelism) falls back."""
    lay = layout(*EIGHT_BLOCKS, "parallel.tp=2")
    calib = calibration(lay)
    flops = block_flops(lay.shape, lay.tokens, lay.seq_len, 2)
    for kind, x in zip(("block_f", "block_b", "block_w"), flops, strict=True):
        calib.compute[tp_kind(kind, 2, False)] = [[x, 2.0]]
    timed = predict(lay, calib, network(), "test cpu")
    assert timed.step_time_s == pytest.approx(8 * 6)
    hf = head_flops(lay.shape.n_embd, lay.vocab, lay.tokens, 2)  # the head and loss timed whole too: 5 s and 10 s
    calib.compute[tp_kind("head_f", 2, False)] = [[hf, 5.0]]
    calib.compute[tp_kind("head_bw", 2, False)] = [[2 * hf, 10.0]]
    assert predict(lay, calib, network(), "test cpu").step_time_s == pytest.approx(8 * 6 + 15)
    sp = layout(*EIGHT_BLOCKS, "parallel.tp=2", "parallel.sequence_parallel=true")
    assert predict(sp, calib, network(), "test cpu").step_time_s == pytest.approx(8 * 3)


@pytest.mark.parametrize(("words", "expected"), [
    # fp32: the root once and each of 8 blocks twice gathered (3/4 of each sent over 4 ranks), each reduce-scattered
    ([], lambda root, block: 0.75 * (root + 16 * block) + 0.75 * (8 * block + root)),
    # bf16 gathers send half the bytes; the reduce-scatters stay fp32
    (["parallel.param_comm=bf16"], lambda root, block: 0.375 * (root + 16 * block) + 0.75 * (8 * block + root)),
    # hpZ over nodes of 2: the forward's gathers cross (3/4), backward's stay in the node (1/2 over 2 ranks)
    (["parallel.hpz=true", "parallel.hpz_node_size=2"],
     lambda root, block: 0.75 * (root + 8 * block) + 0.5 * 8 * block + 0.75 * (8 * block + root)),
])
def test_fsdp_gathers_are_priced_in_their_wire_type_and_group(words: list[str], expected) -> None:
    lay = layout(*EIGHT_BLOCKS, "parallel.dp=4", "parallel.dp_sync=fsdp", *words)
    bandwidth = 1e9
    pred = predict(lay, calibration(lay), network(0.0, bandwidth), "test cpu")  # a CPU: every collective exposed
    root, block = lay.end_parameters(0) * 4, lay.block_parameters * 4
    assert pred.exposed_comm_s["fsdp gathers and reduce-scatters"] == pytest.approx(expected(root, block) / bandwidth)
    copy = lay.rank_parameters(0) * 4 / 2 if lay.hpz_node else 0  # hpZ's secondary copy: N·4/L
    assert pred.memory["hpz"] == int(copy)
    assert pred.memory["total"] == pred.memory["state"] + pred.memory["activations"] + pred.memory["gathered"] + copy


def test_expert_parallel_splits_the_experts_and_says_what_it_approximates() -> None:
    """Over ep = 2 each rank holds half the experts; the prediction says how it prices their gradients and routing
    (its all-to-alls: tests/plan/test_plan_comm.py)."""
    words = ("model.preset=qwen2-moe-tiny", "data.seq_len=64", "train.batch_size=16", "parallel.dp=2")
    lay = layout(*words, "parallel.ep=2")
    pred = predict(lay, calibration(lay), network(), "test cpu")
    s = lay.shape
    whole = layout(*words)
    assert whole.block_parameters - lay.block_parameters == s.block_parameters() - s.block_parameters(s.n_experts // 2)
    assert any("parallel.ep" in note for note in pred.notes)


def test_a_pipeline_forward_is_priced_as_the_engine_runs_it_counting_saved_bytes() -> None:
    """The engine counts what each forward saves (a hook per saved tensor): a calibration that timed that forward
    (block_f_counted, here 2 s against 1) prices the pipeline's forwards with it, and only the pipeline's."""
    lay = layout(*EIGHT_BLOCKS, "parallel.pp=2", "parallel.chunks=4", "parallel.pp_schedule=gpipe")
    calib = calibration(lay)
    plain = predict(lay, calib, network(), "test cpu")
    calib.compute["block_f_counted"] = [[x, 2.0] for x, _ in calib.compute["block_f"]]
    counted = predict(lay, calib, network(), "test cpu")
    assert counted.compute_s - plain.compute_s == pytest.approx(4 * 4)  # 4 micro-batches x 4 blocks a rank, 1 s more
    single = layout(*EIGHT_BLOCKS)
    calib = calibration(single)
    calib.compute["block_f_counted"] = [[x, 2.0] for x, _ in calib.compute["block_f"]]
    assert predict(single, calib, network(), "test cpu").compute_s == pytest.approx(8 * 3)


def test_a_pipeline_adds_the_tied_embedding_all_reduce_and_the_grouped_clip() -> None:
    """GPT-2's tied table has a copy on the first and the last stage, whose gradients are all-reduced over those two
    ranks after the schedule (exposed); stages sum the norm's squares per tensor, the grouped clip the calibration
    timed (here 5 s), where one process takes torch's (free here)."""
    lay = layout(*EIGHT_BLOCKS, "parallel.pp=2", "parallel.chunks=4")
    calib = calibration(lay)
    calib.compute["optimizer_grouped"] = [[1e3, 5.0], [1e9, 5.0 * 1e6]]  # 5 s per 1,000 parameters
    latency, bandwidth = 1e-3, 1e9
    pred = predict(lay, calib, network(latency, bandwidth), "test cpu")
    table = lay.vocab * lay.shape.n_embd * 4
    assert pred.exposed_comm_s["tied embedding all_reduce"] == pytest.approx(2 * latency + table / bandwidth)
    slowest = max(lay.rank_parameters(r) for r in range(2))
    assert pred.compute_s == pytest.approx(4 * 4 * 3 + slowest * 5e-3)  # 4 micro-batches x 4 blocks x 3 s a rank
    single = layout(*EIGHT_BLOCKS)
    one = calibration(single)
    one.compute["optimizer_grouped"] = calib.compute["optimizer_grouped"]
    assert predict(single, one, network(), "test cpu").compute_s == pytest.approx(8 * 3)


def test_a_sharded_optimizer_is_priced_for_its_shard_only() -> None:
    """zero1 steps 1/dp of the parameters on each rank, bucketed all of them: at the calibration's 5 s per 1,000
    parameters (both the plain and the grouped clip's step), dp=2 saves half the whole step's optimizer time."""
    whole, sharded = (layout(*EIGHT_BLOCKS, "parallel.dp=2", f"parallel.dp_sync={sync}")
                      for sync in ("bucketed", "zero1"))
    calib = calibration(whole)
    calib.compute["optimizer"] = calib.compute["optimizer_grouped"] = [[1e3, 5.0], [1e9, 5.0 * 1e6]]
    plain, shard = (predict(lay, calib, network(), "test cpu").compute_s for lay in (whole, sharded))
    assert plain - shard == pytest.approx(whole.rank_parameters(0) * 5e-3 / 2)


def test_our_tensor_parallel_pieces_take_the_grouped_clip_and_torchs_take_torchs() -> None:
    """Our tp pieces sum the norm's squares per tensor over the tp group (the grouped clip, here 5 s per 1,000
    parameters); torch's DTensor pieces take torch's own norm (free here), as Trainer._norm_plan picks them, and the
    prediction says that torch's tp is priced as ours."""
    ours = layout(*EIGHT_BLOCKS, "parallel.tp=2")
    theirs = layout(*EIGHT_BLOCKS, "parallel.tp=2", "parallel.tp_impl=torch")
    calib = calibration(ours)
    calib.compute["optimizer_grouped"] = [[1e3, 5.0], [1e9, 5.0 * 1e6]]
    grouped, plain = (predict(lay, calib, network(), "test cpu") for lay in (ours, theirs))
    assert grouped.compute_s - plain.compute_s == pytest.approx(ours.rank_parameters(0) * 5e-3)
    assert any("tp_impl=torch" in note for note in plain.notes) and not grouped.notes


def test_each_pipeline_stage_is_priced_by_its_own_blocks() -> None:
    """Interleaved stages of 3, 3, 1 and 1 blocks (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3): each action
    costs its own stage's blocks (F, B and W 1 s a block, the head free), not half its rank's, so the step is the
    schedule simulated with those costs, and another cut with the same blocks per rank (2, 2, 2, 2) differs."""
    words = (*EIGHT_BLOCKS, "parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b",
             "parallel.chunks=2")
    uneven, even = (layout(*words, f"parallel.pp_split={cut}") for cut in ("3,3,1,1", "2,2,2,2"))
    steps = []
    for lay in (uneven, even):
        lists = schedule("interleaved_1f1b", 2, 2, 2)
        blocks = lay.stage_blocks
        expected = simulate(lists, cost_of=lambda a, blocks=blocks: blocks[a.stage] * (1.0 if a.kind == "F" else 2.0))
        steps.append(predict(lay, calibration(lay), network(), "test cpu").step_time_s)
        assert steps[-1] == pytest.approx(expected.makespan)
    assert steps[0] != pytest.approx(steps[1])


@pytest.mark.parametrize("dp", [1, 2])  # dp=1: one device, the sync over a group of one (group_of_one)
@pytest.mark.parametrize(("sync", "offload", "copies"), [
    ("zero2", "optimizer", 2),  # the gradient shard down and the updated shard up, once a step
    ("fsdp2", "params", 1 + 2 * 2),  # the gradient shard down once; the shard up for each of 2 micro-steps' 2 gathers
])
def test_offload_prices_its_host_device_copies_and_moves_the_state_to_the_host(sync: str, offload: str,
                                                                                copies: int, dp: int) -> None:
    words = (*EIGHT_BLOCKS, f"parallel.dp={dp}", f"parallel.dp_sync={sync}", "train.grad_accum=2")
    plain, moved = layout(*words), layout(*words, f"parallel.offload={offload}")
    link = LinkFit(1e-5, 2e9, "test link")
    net = dataclasses.replace(network(), host_device=link)
    a, b = (predict(lay, calibration(lay), net, "test cpu") for lay in (plain, moved))
    n = plain.rank_parameters(0)
    assert b.exposed_comm_s["host-device copies"] == pytest.approx(1e-5 + copies * 4 * n / dp / 2e9)
    assert b.step_time_s - a.step_time_s == pytest.approx(b.exposed_comm_s["host-device copies"])
    assert "host-device copies" not in a.exposed_comm_s
    host = 16 * n / dp  # 16N/W on the host: AdamW's state with (zero2) the fp32 shard and its gradient, or (fsdp2) all
    assert b.memory["host"] == int(host) and a.memory["host"] == 0
    assert b.memory["state"] == a.memory["state"] - (int(host) if offload == "params" else 8 * n // dp)
    # the device's total; at dp=1 only the offloaded run builds a sync, whose units are copied in to run (gathered)
    assert b.memory_bytes == a.memory_bytes - (a.memory["state"] - b.memory["state"]) + (
        b.memory["gathered"] - a.memory["gathered"])
    assert b.memory["gathered"] == a.memory["gathered"] or (dp, sync) == (1, "fsdp2")
    moved = ("optimizer",) if offload == "optimizer" else ("params", "grads", "optimizer")
    assert all(b.memory[part] == (0 if part in moved else a.memory[part]) for part in ("params", "grads", "optimizer"))


def test_the_host_device_link_is_the_profiles_else_pcie() -> None:
    lay = layout("model.preset=gpt2-tiny")
    calib = calibration(lay)
    pcie = network_of(calib, {}, "local", True).host_device
    assert pcie.bandwidth == 25e9 and "PCIe 4.0 x16" in pcie.source
    profile = {"links": {"host_device": {"bandwidth_GBps": 50, "source": "NVLink-C2C"}}}
    assert network_of(calib, profile, "gh", True).host_device.bandwidth == 50e9


@pytest.mark.parametrize("impl", ["ring", "all_to_all"])
def test_a_context_parallel_rank_computes_its_share_and_sends_the_closed_form(impl: str) -> None:
    """cp=2: each rank computes and keeps seq_len / 2 of every sequence (a block of the whole-sequence layout takes
    1 s per F, B and W, so one of cp's takes 0.5 s), sends `exchange`'s calls of the closed form's bytes per block,
    and all-reduces its gradients over the 2 replicas as dp=2 does."""
    whole = layout(*EIGHT_BLOCKS)
    lay = layout(*EIGHT_BLOCKS, "parallel.cp=2", f"parallel.cp_impl={impl}")
    latency, bandwidth = 1e-3, 1e8
    pred = predict(lay, calibration(whole), network(latency, bandwidth), "test cpu")
    assert (pred.gpus, lay.tokens, lay.step_tokens) == (2, whole.tokens // 2, whole.step_tokens)
    assert pred.compute_s == pytest.approx(8 * 3 * 0.5)
    e = exchange(impl, 2, lay.attention(4))
    calls = 8 * (e.forward + e.backward)  # a ring step is one latency, an all-to-all over 2 ranks one
    sent = sent_bytes(impl, 2, lay.attention(4))[e.op]
    assert pred.exposed_comm_s[CP_LABEL[impl]] == pytest.approx(calls * latency + sent / bandwidth)
    alone = predict(whole, calibration(whole), network(latency, bandwidth), "test cpu")
    assert pred.memory["activations"] == alone.memory["activations"] // 2
    assert pred.memory["state"] == alone.memory["state"]  # whole gradients: nothing shards over cp
    dp2 = layout(*EIGHT_BLOCKS, "parallel.dp=2")
    dp2_pred = predict(dp2, calibration(dp2), network(latency, bandwidth), "test cpu")
    assert pred.exposed_comm_s["all_reduce"] == pytest.approx(dp2_pred.exposed_comm_s["all_reduce"])
    assert pred.step_time_s == pytest.approx(pred.compute_s + sum(pred.exposed_comm_s.values()))


def cp_timed(lay: Layout, seconds: tuple[float, float, float]) -> Calibration:
    """The plain block's 1 s per F, B and W on the whole-sequence micro-batch (`calibration`), and the cp block of
    `lay`'s cp and cp_impl timed whole at `seconds` on its rank's tokens."""
    calib = calibration(dataclasses.replace(lay, cp=1))
    flops = block_flops(lay.shape, lay.tokens, lay.seq_len)
    for kind, x, s in zip(("block_f", "block_b", "block_w"), flops, seconds, strict=True):
        calib.compute[cp_kind(kind, lay.cp, lay.cp_impl)] = [[x, s]]
    return calib


@pytest.mark.parametrize("impl", ["ring", "all_to_all"])
def test_a_context_parallel_block_timed_whole_is_priced_as_timed(impl: str) -> None:
    """A calibration that timed the cp=2 block whole (its exchanges inside: F 2 s, B 3 s, W 1 s, against the 0.5 s
    each the plain block's rate gives its tokens) prices each of the 8 blocks so: the exchange the network prices is
    taken out of F and B and shown as exposed, so compute plus that exchange is the timed 8 x 6 s; a block timed twice
    as slow, twice that; under recomputation each forward twice (8 x 8 s), not the plain recomputed block's rate."""
    lay = layout(*EIGHT_BLOCKS, "parallel.cp=2", f"parallel.cp_impl={impl}")
    net = network(1e-3, 1e8)
    e = exchange(impl, 2, lay.attention(4))
    sent = sent_bytes(impl, 2, lay.attention(4))[e.op]
    exchanged = 8 * (e.forward + e.backward) * 1e-3 + sent / 1e8  # as the plain-rate test above: still shown
    for seconds, blocks in (((2.0, 3.0, 1.0), 8 * 6), ((4.0, 6.0, 2.0), 8 * 12)):
        pred = predict(lay, cp_timed(lay, seconds), net, "test cpu")
        assert pred.exposed_comm_s[CP_LABEL[impl]] == pytest.approx(exchanged)
        assert pred.compute_s + pred.exposed_comm_s[CP_LABEL[impl]] == pytest.approx(blocks)
        assert not any("parallel.cp" in note for note in pred.notes)  # nothing approximated: it was timed
    recomputed = dataclasses.replace(lay, checkpoint_every=1)
    calib = cp_timed(recomputed, (2.0, 3.0, 1.0))
    calib.compute.update({kind: [[x, 1.0]] for kind, (x, _) in zip(RECOMPUTED, (calib.compute[k][0] for k in (
        "block_f", "block_b", "block_w")), strict=True)})  # the plain block recomputed, at 0.5 s a cp rank's share
    pred = predict(recomputed, calib, net, "test cpu")
    forward_exchange = 8 * e.forward * 1e-3 + sent * e.forward / (e.forward + e.backward) / 1e8
    assert pred.exposed_comm_s[CP_LABEL[impl]] == pytest.approx(exchanged + forward_exchange)
    assert pred.compute_s + pred.exposed_comm_s[CP_LABEL[impl]] == pytest.approx(8 * 8)


@pytest.mark.parametrize("impl", ["ring", "all_to_all"])
def test_a_calibration_without_that_cp_block_prices_it_at_the_plain_blocks_rate_and_says_so(impl: str) -> None:
    """An older calibration (no cp block timed), or one that timed the other implementation or another cp, prices
    the block at the plain block's rate on the rank's tokens (0.5 s each of F, B and W here) with the exchange
    beside it, and says so in a note."""
    lay = layout(*EIGHT_BLOCKS, "parallel.cp=2", f"parallel.cp_impl={impl}")
    other = "all_to_all" if impl == "ring" else "ring"
    cp4 = layout(*EIGHT_BLOCKS, "parallel.cp=4", f"parallel.cp_impl={impl}")
    older, of_other = calibration(layout(*EIGHT_BLOCKS)), cp_timed(dataclasses.replace(lay, cp_impl=other), (9.0,) * 3)
    for calib in (older, of_other):
        pred = predict(lay, calib, network(), "test cpu")
        assert pred.compute_s == pytest.approx(8 * 3 * 0.5)
        assert any(f"parallel.cp=2, cp_impl={impl}: the calibration timed no such block" in n for n in pred.notes)
    pred = predict(cp4, cp_timed(lay, (9.0, 9.0, 9.0)), network(), "test cpu")
    assert pred.compute_s == pytest.approx(8 * 3 * 0.25)


def test_a_ring_hop_that_wraps_round_a_node_is_priced_on_the_inter_node_link() -> None:
    """cp=4 over 2-GPU nodes: ranks 0 and 1 share a node, 3 -> 0 does not; every ring step waits for that hop."""
    lay = layout(*EIGHT_BLOCKS, "parallel.cp=4")
    fast, slow = LinkFit(0.0, 1e10), LinkFit(0.0, 1e8)
    pred = predict(lay, calibration(lay), Network(intra=fast, inter=slow, gpus_per_node=2), "test cpu")
    e = exchange("ring", 4, lay.attention(4))
    assert pred.exposed_comm_s["cp send_recv"] == pytest.approx(8 * (e.forward + e.backward) * e.nbytes / 1e8)
