"""Context parallelism (parallel.cp): the load-balanced split as a known answer, and on two ranks as threads of the
test process (real gloo, fast tier) a tiny GPT-2's, Llama's and Qwen2's loss and gradients, each rank holding its
shard of every row, equal to one process's with both implementations; packed rows (each example its own positions,
no attention across examples) and the mixtures with their load-balancing loss (over the whole rows' real positions)
likewise; what attention saves for backward on 1, 2 and 4 ranks, the closed form; the architecture's pieces (what
tensor and pipeline parallelism run) at the shard's global positions; each refused layout's one line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from thread_ranks import run_threads

from gptpar.config import example_width, fixed_width, load_config
from gptpar.data.pairs import IGNORE
from gptpar.errors import ConfigError, GptparError
from gptpar.models import architecture
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.context_parallel import ContextParallel, shard_positions
from gptpar.parallel.placement import logits
from gptpar.parallel.tensor_parallel import tensor_parallel_forward
from gptpar.strategies.context_parallel import AttentionShape, attention_bytes
from gptpar.train.moe import RouterLoad
from gptpar.train.trainer import micro_loss

VOCAB, ROWS, SEQ = 64, 2, 16


def test_the_load_balanced_split_gives_rank_r_chunks_r_and_its_mirror() -> None:
    # 16 positions in 2 * cp = 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # cp = 4: chunks of 2, rank 1 holds chunks 1 and 6; every rank's causal work (sum of visible keys) is equal
    assert shard_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    work = [int((shard_positions(16, 4, r) + 1).sum()) for r in range(4)]
    assert work == [work[0]] * 4


def _model(preset: str, *overrides: str) -> torch.nn.Module:
    return build_model(load_config(None, [f"model.preset={preset}", *overrides]).model, VOCAB, seed=3)


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
    assert [saved[cp][0] * cp for cp in (2, 4)] == [saved[1][0]] * 2  # exactly 1/cp, all_to_all's reorders included


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


# Two packed rows of 16 (data.packing): examples of 5, 7 and 4 positions, then 9 and 7; position ids restart at each
# example. Under cp=2 every row's chunks 0 and 3 are rank 0's, so each rank holds pieces of several examples.
PACKED = torch.tensor([[*range(5), *range(7), *range(4)], [*range(9), *range(7)]])
AUX_COEF = 0.1
SMALL = ("model.n_layer=2", "model.n_embd=32")
MIXTURE = (f"model.moe_aux_loss_coef={AUX_COEF}",)


def _packed_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs, labels = _rows()
    labels = labels.clone()
    # Row 0: its second example's prompt (6-11, all rank 1's) and a padding tail (14, 15) unlabelled. Rank 1's 6-11
    # are real positions (rank 0's 12 and 13 carry labels after them) though no label of its own follows them.
    labels[0, 6:12] = labels[0, 14:] = IGNORE
    return inputs, labels, PACKED


def _total_loss(out: torch.Tensor, labels: torch.Tensor, targets: int, router: RouterLoad | None,
                whole_labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of these positions' labels as a share of the `targets` of the whole rows, plus the router's
    load-balancing loss over the whole rows (RouterLoad.aux_loss)."""
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum") / targets
    return loss + AUX_COEF * router.aux_loss(whole_labels) if router is not None else loss


def _router(model: torch.nn.Module, group: dist.ProcessGroup | None, replicas: int) -> RouterLoad | None:
    """A mixture's routers watched as the trainer watches them (None for a dense model)."""
    routers = architecture(model).routers(model)
    return (RouterLoad(routers, routers[0].weight.size(0), model.config.num_experts_per_tok, group, replicas)
            if routers else None)


def _one_process(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process's loss and gradients of whole (packed) rows, as the trainer runs them (placement.logits)."""
    router = _router(model, None, 1)
    with router.recording() if router is not None else torch.enable_grad():
        out = logits(model, torch.device("cpu"), batch[0], batch[2] if len(batch) > 2 else None)
    loss = _total_loss(out, batch[1], int((batch[1] != IGNORE).sum()), router, batch[1])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _context_rank(model: torch.nn.Module, impl: str, batch: tuple[torch.Tensor, ...]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's shard of `batch` through `model`: the loss and gradients averaged over the cp ranks as the sync
    does, each rank's loss the cp-fold of its share (as the trainer's divisors make it)."""
    context = ContextParallel(dist.group.WORLD, impl)
    context.attach(model)
    router = _router(model, dist.group.WORLD, context.size)
    if router is not None:
        router.context = context  # it is handed this rank's shard of the labels
    inputs, labels, positions = context.shard(batch)
    with context.sharded(batch[2] if len(batch) > 2 else None):
        with router.recording() if router is not None else torch.enable_grad():
            out = logits(model, torch.device("cpu"), inputs, positions)
        share = _total_loss(out, labels, int((batch[1] != IGNORE).sum()), None, batch[1]) * context.size
        loss = share + AUX_COEF * router.aux_loss(labels) if router is not None else share
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= context.size
    loss = loss.detach()
    dist.all_reduce(loss)
    return loss / context.size, grads


# Each implementation once, with learned positions (GPT-2) and rotary ones (Llama).
@pytest.mark.parametrize(("preset", "impl"), [("gpt2-tiny", "all_to_all"), ("llama-tiny", "ring")])
def test_packed_rows_keep_their_examples_apart_as_one_process(preset: str, impl: str) -> None:
    """Each token keeps its example's position id and sees only its example's keys (packed_attention's mask)."""
    loss, grads = _one_process(_model(preset, *SMALL), _packed_rows())
    for rank_loss, rank_grads in run_threads(2, lambda r: _context_rank(_model(preset, *SMALL), impl,
                                                                        _packed_rows())):
        torch.testing.assert_close(rank_loss, loss, rtol=0, atol=1.5e-6)  # measured 4.8e-7 (loss about 4.2)
        for name, grad in grads.items():  # measured at most 6.0e-8 (both implementations), elementwise
            torch.testing.assert_close(rank_grads[name], grad, rtol=0, atol=2e-7, msg=name)


@pytest.mark.parametrize(("preset", "impl"), [("mixtral-tiny", "ring"), ("qwen2-moe-tiny", "all_to_all")])
def test_a_mixture_and_its_balancing_loss_equal_one_process(preset: str, impl: str) -> None:
    """The routers' statistics are summed over the cp ranks, each counting its shard of the whole rows' real
    positions (row 0's unlabelled tail routes but does not count)."""
    loss, grads = _one_process(_model(preset, *SMALL, *MIXTURE), _packed_rows()[:2])
    for rank_loss, rank_grads in run_threads(2, lambda r: _context_rank(_model(preset, *SMALL, *MIXTURE), impl,
                                                                        _packed_rows()[:2])):
        torch.testing.assert_close(rank_loss, loss, rtol=0, atol=1.5e-6)  # measured 0 (one ulp of 4.4 is 4.8e-7)
        for name, grad in grads.items():  # measured at most 3.0e-8 (both implementations), elementwise
            torch.testing.assert_close(rank_grads[name], grad, rtol=0, atol=1e-7, msg=name)


def test_a_shard_without_targets_backpropagates_zeros() -> None:
    """A cp rank's shard of pair rows may hold only prompts and padding: its loss is zero, not 0/0, and its backward
    (which its peers' ring and sync wait for) gives zero gradients, a padded head's -inf columns too."""
    logits = torch.randn(2, 4, VOCAB)
    logits[..., -1] = -math.inf  # PaddedHead's column past the tokenizer's vocabulary
    logits.requires_grad_()
    loss = micro_loss(lm_loss, logits, torch.full((2, 4), IGNORE), math.inf)
    loss.backward()
    assert loss.item() == 0 and torch.equal(logits.grad, torch.zeros_like(logits))


BASE = ["model.preset=gpt2-tiny", "data.seq_len=16", "parallel.cp=2"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.pp_mode=model_parallel"], "parallel.cp=2 composes with data, expert, tensor and pipeline parallelism, "
                                          "not with parallel.pp_mode=model_parallel; set parallel.pp_mode=single, or "
                                          "parallel.cp=1"),
    *(([split, "data.task=sft", "data.source=metamath_sample", "data.packing=true"],  # as without cp
       f"data.packing=true needs the model run whole, which {split} splits; use data.packing=false there")
      for split in ("parallel.tp=2", "parallel.pp=2")),
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
    *(([f"parallel.cp_impl={impl}", "data.seq_len=18"],  # all_to_all's shards too: 18 would drop 2 positions
       "parallel.cp=2 splits data.seq_len=18 into 2 * parallel.cp = 4 chunks, two a rank (an equal share of the causal "
       "work); use a seq_len that is a multiple of 4") for impl in ("ring", "all_to_all")),
    (["parallel.cp_impl=all_to_all", "parallel.cp=3", "data.seq_len=24"],
     "parallel.cp_impl=all_to_all needs model.n_head=4 divisible by parallel.cp=3; use a multiple of 3, or "
     "parallel.cp_impl=ring"),
    (["model.dropout=0.1"], "parallel.cp=2 runs attention without dropout, so model.dropout=0.1 would not reach it "
                            "(the embeddings' and residuals' would); use model.dropout=0, or parallel.cp=1"),
    (["model.preset=vit-tiny"], "parallel.cp=2 is built for model.arch=gpt2, llama, qwen2, mixtral or qwen2_moe, not "
                                "vit; use one of them, or parallel.cp=1"),
])
def test_each_layout_cp_cannot_take_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*BASE, *overrides])
    assert str(caught.value) == message


PAIRS = ["data.task=sft", "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=24",
         "data.max_target_len=24", "model.preset=mixtral-tiny", "parallel.cp=2"]


@pytest.mark.parametrize(("impl", "packing", "pieces"), [
    ("ring", True, []), ("all_to_all", False, []), ("ring", False, ["parallel.tp=2"]),
    ("all_to_all", False, ["parallel.pp=2"])])
def test_pair_rows_are_padded_to_a_width_the_split_divides(impl: str, packing: bool, pieces: list[str]) -> None:
    """sft rows of a mixture, packed or not (unpacked under tensor or pipeline parallelism), take cp (no refusal),
    their width 24 + 24 + 1 rounded up to the 2 cp chunks either implementation shards a row into, every batch that
    wide (not its longest example's)."""
    width = 52
    cfg = load_config(None, [*PAIRS, f"parallel.cp_impl={impl}", f"data.packing={str(packing).lower()}", *pieces])
    assert example_width(cfg) == fixed_width(cfg) == width
    assert example_width(load_config(None, [*PAIRS, f"parallel.cp_impl={impl}", "parallel.cp=1"])) == 49  # as before


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
