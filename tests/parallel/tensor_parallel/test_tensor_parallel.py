"""Tensor parallelism through the trainer: ours and torch's at T=2 (with sequence and loss parallelism), the
compositions DP x TP, FSDP x TP and PP x TP on 4 ranks and PP x TP x DP (3D) on 8, each equal to one process;
checkpoints resume exactly.

The vocabulary (301) does not divide by 2: the token table is built padded (to model.pad_vocab's multiple of 64, which
tp divides), and the masking of the padding in the vocabulary-parallel layers and loss is exercised too.
Every spawned rank trains through `Trainer.train_step` and saves its losses and whole parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
    STEPS,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    saved_ranks,
    train_steps,
)
from transformers import GPT2LMHeadModel

from gptpar.config import ConfigError, ModelConfig, load_config
from gptpar.models.build import model_config
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.tensor_parallel.layers import dropout
from gptpar.train.checkpoint import export_checkpoint

TP = ["parallel.tp=2", "data.vocab_size=301"]
SP_LP = ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]
TORCH = ["parallel.tp_impl=torch"]
CASES_2 = {
    "tp2": TP,
    "tp2-sp-lp": [*TP, *SP_LP],
    "tp2-lp-accum-ckpt": [*TP, "parallel.loss_parallel=true", "train.grad_accum=2",
                          "train.activation_checkpointing=block"],
    "tp2-torch-sp-lp": [*TP, *TORCH, *SP_LP],
}
CASES_4 = {
    "dp2-tp2-ddp-sp": [*TP, "parallel.dp=2", "parallel.dp_sync=ddp", *SP_LP],
    "zero2-tp2": [*TP, "parallel.dp=2", "parallel.dp_sync=zero2", "parallel.bucket_mb=0.01"],
    "fsdp-tp2": [*TP, "parallel.dp=2", "parallel.dp_sync=fsdp", *SP_LP],
    "fsdp2-tp2-torch": [*TP, *TORCH, "parallel.dp=2", "parallel.dp_sync=fsdp2"],
    "pp2-tp2-sp-lp": [*TP, "parallel.pp=2", "parallel.chunks=2", *SP_LP],
}
CASES_8 = {"3d": [*TP, "parallel.pp=2", "parallel.dp=2", "parallel.chunks=2", "model.n_layer=2"]}  # pp x tp x dp
# A resume of each kind of state: SP/LP pieces, and pieces sharded again by fsdp. (torch's TP without SP is
# fsdp2-tp2-torch's, plain dp x tp the 3D case's, pp x tp without SP the 3D case's too.)
RESUMED = {"tp2-sp-lp": 2, "fsdp-tp2": 4}
ALL = CASES_2 | CASES_4 | CASES_8
# Parameters after STEPS AdamW steps, absolute: a share of one step of train.lr. AdamW normalises each element's
# update, so an element whose gradient is rounding noise moves by a rounding-dependent part of lr: the worst measured,
# over every case above (Intel Xeon), is one element of transformer.h.2.mlp.c_proj.weight (about -1.3e-3) at
# 7.3e-6..1.02e-5 (tp2-lp-accum-ckpt), 1.0e-3 of a step; 3x that. A wrong plan moves whole rows by about a step.
PARAM_ATOL_STEPS = 3e-3


def _worker(info: RankInfo, runs: Path, cases: dict[str, list[str]]) -> None:
    for name, overrides in cases.items():
        trainer = make_trainer(make_config(overrides, runs, name), info)
        losses = train_steps(trainer, STEPS)
        record = {"losses": [trainer.logged_loss(v) for v in losses], "val": trainer.evaluate(),
                  "params": named_params(trainer)}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    if info.world_size == 2:
        _dropout_masks(info, runs)
    for name, world in RESUMED.items():  # a step, a checkpoint, a new trainer: the next step as if never stopped
        if world != info.world_size:
            continue
        record = resumed_run(make_config(ALL[name], runs, f"resumed-{name}"), info)
        torch.save(record, runs / f"resumed-{name}.rank{info.rank}.pt")


def _dropout_masks(info: RankInfo, runs: Path) -> None:
    """Masks of layers.dropout on this rank: replicated twice in a row, sharded, and sharded again from the
    generator state before the first sharded draw (what activation checkpointing's recompute does)."""
    torch.manual_seed(7)  # the same seed on every rank, as train.seed is
    ones = torch.ones(4096)
    replicated = torch.stack([dropout(ones, 0.5, True, None), dropout(ones, 0.5, True, None)])
    state = torch.get_rng_state()
    sharded = dropout(ones, 0.5, True, info.rank)
    after = dropout(ones, 0.5, True, None)
    torch.set_rng_state(state)
    replayed = dropout(ones, 0.5, True, info.rank)
    torch.save({"replicated": replicated, "sharded": sharded, "replayed": replayed, "after": after},
               runs / f"dropout.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("tp")
    for world, cases in ((2, CASES_2), (4, CASES_4), (8, CASES_8)):
        gloo_pool.run(world, _worker, runs, cases)
    return runs


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.slow
def test_tensor_parallel_trains_like_one_process(results: Path, name: str) -> None:
    ranks = saved_ranks(results, name)
    cfg = make_config(ALL[name], results, name)
    ref = reference_run(cfg)
    losses = [r["losses"] for r in ranks if r["losses"][0] is not None]  # a pipeline's first stage logs null
    mean = [sum(step) / len(losses) for step in zip(*losses, strict=True)]
    assert mean == pytest.approx(ref["losses"], rel=1e-5)
    assert all(r["val"] == pytest.approx(ref["val"], rel=1e-5) for r in ranks)
    model: dict[str, torch.Tensor] = {}  # the whole model, from every rank (a pipeline stage holds its blocks)
    for rank in ranks:
        for param, value in rank["params"].items():
            assert torch.equal(model.setdefault(param, value), value), param  # every holder: the same tensor
    assert set(model) >= set(ref["params"]) - {"lm_head.weight"}
    for param, value in model.items():
        expected = ref["params"]["transformer.wte.weight" if param == "lm_head.weight" else param]
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=PARAM_ATOL_STEPS * cfg.train.lr,
                                   msg=lambda m, p=param: f"{name}: {p}: {m}")


@pytest.mark.parametrize("name", list(RESUMED))
@pytest.mark.slow
def test_a_resumed_tensor_parallel_run_continues_exactly(results: Path, name: str) -> None:
    straight, resumed = saved_ranks(results, name), saved_ranks(results, f"resumed-{name}")
    for a, b in zip(straight, resumed, strict=True):
        if a["losses"][1] is not None:  # a pipeline's first stage logs no loss
            assert b["losses"][0] == pytest.approx(a["losses"][1], rel=1e-6)
        for param, value in a["params"].items():
            torch.testing.assert_close(b["params"][param], value, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_dropout_masks_agree_where_replicated_and_differ_where_sharded(results: Path) -> None:
    ranks = saved_ranks(results, "dropout")
    for key in ("replicated", "after"):  # the shared stream stays in step across a sharded draw
        assert all(torch.equal(r[key], ranks[0][key]) for r in ranks), key
    assert not torch.equal(ranks[0]["sharded"], ranks[1]["sharded"])  # each rank its own mask
    assert all(torch.equal(r["sharded"], r["replayed"]) for r in ranks)  # a recompute draws the same mask


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_as_a_whole_gpt2(results: Path, tmp_path: Path) -> None:
    """Pieces rebuilt whole: q, k, v columns in GPT-2's order, the token table's padding (model.pad_vocab's 64, which
    tp=2 divides) cut off; the padded rows were never trained."""
    exported = torch.load(export_checkpoint(results / "resumed-tp2-sp-lp", tmp_path / "model.pt"), weights_only=False)
    model = GPT2LMHeadModel(model_config(ModelConfig(n_layer=4, n_embd=32, n_head=2), 301))
    model.load_state_dict(exported["gpt2"])
    saved = saved_ranks(results, "resumed-tp2-sp-lp")[0]["saved"]
    for name, value in model.named_parameters():
        trained = saved[name]
        if name == "transformer.wte.weight":
            assert trained.shape[0] == 320 and not trained[301:].any()
            trained = trained[:301]
        assert torch.equal(value.detach(), trained), name


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.tp=3"], "parallel.tp=3 must divide model.n_head=2"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=15"], "multiple of 2"),
    (["parallel.tp=2", "parallel.pp_mode=pipeline_parallel"], "cannot be combined with parallel.tp=2"),
    (["parallel.tp=2", "parallel.tp_impl=torch", "parallel.dp=2"], "needs parallel.dp_sync=fsdp2"),
    (["parallel.tp=2", "parallel.tp_impl=torch", "parallel.pp=2"], "does not compose with parallel.pp > 1"),
    (["parallel.tp=2", "parallel.dp=2", "parallel.dp_sync=fsdp2"], "use parallel.dp_sync=fsdp (ours)"),
])
def test_impossible_tensor_parallel_layouts_fail_in_one_line(overrides: list[str], message: str) -> None:
    base = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(None, [*base, *overrides])
    assert "\n" not in str(err.value)
