"""Context parallelism (parallel.cp): the load-balanced split as a known answer, and on two ranks as threads of the
test process (real gloo, fast tier) a tiny GPT-2's, Llama's and Qwen2's loss and gradients, each rank holding its
shard of every row, equal to one process's with both implementations; what attention saves for backward on 1, 2 and 4
ranks, the closed form; the architecture's pieces (what tensor and pipeline parallelism run) at the shard's global
positions; each refused layout's one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from thread_ranks import run_threads

from gptpar.config import load_config
from gptpar.errors import ConfigError, GptparError
from gptpar.models.build import build_model
from gptpar.parallel.context_parallel import ContextParallel, shard_positions
from gptpar.parallel.tensor_parallel import tensor_parallel_forward
from gptpar.strategies.context_parallel import AttentionShape, attention_bytes

VOCAB, ROWS, SEQ = 64, 2, 16


def test_the_load_balanced_split_gives_rank_r_chunks_r_and_its_mirror() -> None:
    # 16 positions in 2 * cp = 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # cp = 4: chunks of 2, rank 1 holds chunks 1 and 6; every rank's causal work (sum of visible keys) is equal
    assert shard_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    work = [int((shard_positions(16, 4, r) + 1).sum()) for r in range(4)]
    assert work == [work[0]] * 4


def _model(preset: str) -> torch.nn.Module:
    return build_model(load_config(None, [f"model.preset={preset}"]).model, VOCAB, seed=3)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                    positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(inputs, position_ids=positions).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _sharded(preset: str, impl: str, rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's share of the global mean loss, and its gradients averaged over the cp ranks (what the sync does)."""
    model = _model(preset)
    context = ContextParallel(dist.group.WORLD, impl)
    context.attach(model)
    inputs, labels, positions = context.shard(_rows())
    with context.sharded():
        loss, grads = _loss_and_grads(model, inputs, labels, positions)
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= context.size
    dist.all_reduce(loss)
    return loss / context.size, grads


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("impl", ["ring", "all_to_all"])
def test_cp2_loss_and_gradients_equal_one_process(preset: str, impl: str) -> None:
    loss, grads = _loss_and_grads(_model(preset), *_rows())
    for rank_loss, rank_grads in run_threads(2, lambda rank: _sharded(preset, impl, rank)):
        torch.testing.assert_close(rank_loss, loss, rtol=0, atol=1.5e-6)  # measured 4.8e-7 (loss about 4.25)
        for name, grad in grads.items():  # measured at most 1.8e-7 (Llama's ring), elementwise
            torch.testing.assert_close(rank_grads[name], grad, rtol=0, atol=6e-7, msg=name)


def _saved(preset: str, impl: str) -> int | None:
    """What this rank's attention saved for backward in one sharded forward of `_rows()` (ContextParallel's count)."""
    model = _model(preset)
    context = ContextParallel(dist.group.WORLD, impl, count_saved=True)
    context.attach(model)
    inputs, _, positions = context.shard(_rows())
    with context.sharded():
        model(inputs, position_ids=positions)
    return context.saved_bytes


@pytest.mark.parametrize(("preset", "impl", "kv_heads"), [("gpt2-tiny", "ring", 4), ("llama-tiny", "ring", 2),
                                                          ("llama-tiny", "all_to_all", 2)])
def test_attention_saves_the_closed_form_falling_as_one_over_cp(preset: str, impl: str, kv_heads: int) -> None:
    shape = AttentionShape(layers=4, heads=4, kv_heads=kv_heads, head_dim=32, rows=ROWS, seq=SEQ)  # the tiny presets
    saved = {cp: run_threads(cp, lambda rank, cp=cp: _saved(preset, impl)) for cp in (1, 2, 4)}
    for cp, ranks in saved.items():
        assert ranks == [attention_bytes(impl, cp, shape)] * cp
    index = 0 if impl == "ring" else shape.layers * 2 * SEQ * 8  # all_to_all's two int64 reorders, whole-sequence
    assert [(saved[cp][0] - index) * cp for cp in (2, 4)] == [saved[1][0] - index] * 2


def _pieces_logits(preset: str, impl: str, rank: int) -> torch.Tensor:
    """The logits of this rank's shard through the architecture's pieces (what tensor parallelism and each pipeline
    stage run: token ids in, no position ids), which ask the ContextParallel for the shard's global positions."""
    model = _model(preset)
    context = ContextParallel(dist.group.WORLD, impl)
    context.attach(model)
    inputs, _ = context.shard(_rows(), with_positions=False)
    with context.sharded(), torch.no_grad():
        return tensor_parallel_forward(model, inputs)


@pytest.mark.parametrize(("preset", "impl"), [("gpt2-tiny", "ring"), ("llama-tiny", "all_to_all"),
                                              ("qwen2-tiny", "ring")])
def test_the_pieces_run_the_shard_at_its_global_positions(preset: str, impl: str) -> None:
    with torch.no_grad():
        logits = _model(preset)(_rows()[0]).logits
    for rank, shard in enumerate(run_threads(2, lambda rank: _pieces_logits(preset, impl, rank))):
        # measured at most 3.9e-7 (GPT-2 with the ring; logits up to 1.8)
        torch.testing.assert_close(shard, logits[:, shard_positions(SEQ, 2, rank)], rtol=0, atol=1.2e-6)


BASE = ["model.preset=gpt2-tiny", "data.seq_len=16", "parallel.cp=2"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.pp_mode=model_parallel"], "parallel.cp=2 composes with data, tensor and pipeline parallelism on "
                                          "data.task=lm only, not with parallel.pp_mode=model_parallel; set "
                                          "parallel.ep to 1, parallel.pp_mode=single, data.task=lm and "
                                          "data.packing=false, or parallel.cp=1"),
    (["parallel.tp=2", "parallel.tp_impl=torch"], "parallel.cp=2 composes with parallel.tp_impl=gptpar only, not "
                                                  "parallel.tp_impl=torch (its DTensor gradients are averaged by fsdp2 "
                                                  "over the dp mesh alone, and its attention does not run the cp "
                                                  "exchange); use parallel.tp_impl=gptpar, or parallel.cp=1"),
    (["parallel.tp=4", "parallel.cp_impl=all_to_all"], "parallel.cp_impl=all_to_all trades each rank's model.n_head / "
                                                       "parallel.tp = 1 heads over parallel.cp=2, which do not divide; "
                                                       "use model.n_head a multiple of 8, or parallel.cp_impl=ring"),
    (["parallel.tp=4", "parallel.sequence_parallel=true", "data.seq_len=20"],
     "parallel.sequence_parallel=true splits each of parallel.cp=2's shards of data.seq_len=20 into parallel.tp=4; use "
     "a seq_len that is a multiple of 8"),
    (["parallel.tp=2", "parallel.dp_sync=fsdp2"], "parallel.tp_impl=gptpar with parallel.dp=1 x parallel.cp=2 does not "
                                                  "compose with parallel.dp_sync=fsdp2: use parallel.dp_sync=fsdp "
                                                  "(ours) instead"),
    (["parallel.dp_sync=fsdp", "parallel.dp=2", "parallel.hpz=true"],
     "parallel.hpz=true keeps a copy of the shards within a node's data-parallel ranks, but under parallel.cp=2 they "
     "are sharded over dp * cp ranks; use parallel.hpz=false, or parallel.cp=1"),
    (["data.seq_len=18"], "parallel.cp_impl=ring splits data.seq_len=18 into 2 * parallel.cp = 4 chunks; use a "
                          "seq_len that is a multiple of 4"),
    (["parallel.cp_impl=all_to_all", "parallel.cp=3", "data.seq_len=18"],
     "parallel.cp_impl=all_to_all needs model.n_head=4 divisible by parallel.cp=3; use a multiple of 3, or "
     "parallel.cp_impl=ring"),
    (["model.preset=vit-tiny"], "parallel.cp=2 is built for model.arch=gpt2, llama or qwen2 without experts, not "
                                "vit; use one of them, or parallel.cp=1"),
])
def test_each_layout_cp_cannot_take_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*BASE, *overrides])
    assert str(caught.value) == message


def _sliding(rank: int) -> None:
    model = _model("qwen2-tiny")
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    model = type(model)(model.config)  # the attention modules read the window when built
    context = ContextParallel(dist.group.WORLD, "ring")
    context.attach(model)
    inputs, _, positions = context.shard(_rows())
    with context.sharded():
        model(inputs, position_ids=positions)


def test_a_sliding_window_is_refused_in_one_line() -> None:
    with pytest.raises(GptparError, match=r"^parallel.cp=2 runs full causal attention, not a sliding window of 4; set "
                                          r"the model's use_sliding_window to false, or parallel.cp=1$"):
        run_threads(2, _sliding)
