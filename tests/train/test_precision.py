"""Mixed precision (`train.precision`): bf16 trains like fp32 within bf16's rounding, on one process, and like one
bf16 process on two ranks under every pipeline schedule, data-parallel sync, tensor- and context-parallel
implementation;
fp16's loss scaler skips overflowing steps on a real trainer, on every rank, and recovers; the precisions a CPU
cannot run are one-line errors.

bf16 runs a small byte-level text model whose loss falls fast, so "it trains" shows in six steps. Its losses stay
within 3x of this machine's own bf16 error of fp32's step by step (bf16 keeps 8 bits of mantissa; how a CPU rounds
and sums bf16 products depends on its kernels, AVX512-BF16 or not), measured by torch's autocast in a plain loop on
the same model, batches and optimizer (`_torch_autocast_losses`), yet differ from them (autocast ran). Two ranks
in bf16 agree with one bf16 process: losses within PARALLEL_LOSS_TOL (TP_LOSS_TOL under tensor parallelism, the
ring's validation loss RING_VAL_TOL),
parameters within a mean |difference| of PARALLEL_PARAM_TOL after two AdamW steps (measured against one bf16
process: ~4e-5 for every schedule and data-parallel sync, ~1e-4 for tensor parallelism, whose sharded matmuls sum
their bf16 partial results in another order; ~1.4e-4 against fp32; a missing or wrong gradient moves many
parameters by a whole step, 1e-2).
fp16 needs a GPU, so its scaler runs here with an autocast-free fp32 model or under bf16 autocast: the same code.
"""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import STEPS, make_config, make_trainer, named_params, reference_run, train_steps
from torch import nn

from gptpar.config import Config, updated
from gptpar.errors import GptparError
from gptpar.models.loss import lm_loss
from gptpar.parallel.context_parallel import IMPLS as CP_IMPLS
from gptpar.parallel.pipeline.one_process.pipe import Pipe
from gptpar.parallel.process_group import RankInfo
from gptpar.run.logfile import RankLog, rank_log_path, read_rank_log
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.strategies.pipeline import SCHEDULES
from gptpar.strategies.tensor_parallel import TP_IMPLS
from gptpar.train.checkpoint import load_checkpoint
from gptpar.train.entry import run_rank
from gptpar.train.optim import learning_rate, make_optimizer
from gptpar.train.precision import DynamicLossScaler, Precision
from gptpar.train.provenance import header_fields

TEXT = ["data.source=stdlib", "data.tokenizer=bytes", "data.max_chars=40000", "train.eval_every=0",
        "log.progress=none"]
# bf16's losses against fp32's: within BF16_ERROR_FACTOR times the largest step difference torch's autocast makes on
# the same model, batches and optimizer on this CPU (measured 8.5e-4 with AVX512-BF16, the run's own the same within
# 5e-7), never less than BF16_ERROR_FLOOR (the forward's rounding at equal weights: 2e-5..9e-5).
BF16_ERROR_FACTOR = 3.0
BF16_ERROR_FLOOR = 1e-4
PARALLEL_LOSS_TOL = 1e-3
# Tensor parallelism's sharded matmuls sum their bf16 partial results in another order: its validation loss after the
# steps measured 1.0e-3 and 1.1e-3 (ours, torch's) from one bf16 process on a CPU with native bf16 kernels
# (AVX512-BF16), under 1e-3 on one without.
TP_LOSS_TOL = 2e-3
# The ring (parallel.cp_impl=ring) merges per-block softmaxes in fp32 where one process's sdpa rounds its own way: its
# gradients are as far from fp32's as one bf16 process's (relative L2 6.0e-3 and 5.8e-3) but not the same ones, and
# two AdamW steps carry that into the validation loss: measured 3.0e-3 from one bf16 process (its step losses 1.9e-4,
# its parameters 9.7e-5 in mean |difference|); all_to_all's attention is sdpa's own (2.6e-4, as the pipeline's).
RING_VAL_TOL = 9e-3
PARALLEL_PARAM_TOL = 3e-4  # mean |difference|: 3% of one AdamW step at lr 0.01, 3x tensor parallelism's measured
TIED = {"lm_head.weight": "transformer.wte.weight"}  # the pipeline's head copy of the tied matrix
CPU = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
               launcher="single", backend="gloo", device=torch.device("cpu"))
BF16 = "train.precision=bf16"
# bf16 on two ranks under every row of the strategy tables: each pipeline schedule, each data-parallel sync, each
# tensor-parallel implementation (a new row is tested without a new line here).
PARALLEL_CASES = [
    *((f"pp2-{name}", [BF16, "parallel.pp=2", f"parallel.pp_schedule={name}", "parallel.chunks=2",
                       f"parallel.pp_virtual={2 if row.interleaved else 1}"]) for name, row in SCHEDULES.items()),
    *((f"dp2-{name}", [BF16, "parallel.dp=2", f"parallel.dp_sync={name}"]) for name in DP_STRATEGIES),
    *((f"tp2-{name}", [BF16, "parallel.tp=2", f"parallel.tp_impl={name}"]) for name in TP_IMPLS),
    *((f"cp2-{name}", [BF16, "parallel.cp=2", f"parallel.cp_impl={name}"]) for name in CP_IMPLS),
]


def _log(run_dir: Path) -> RankLog:
    return read_rank_log(rank_log_path(run_dir, 0))


def _config(tmp_path: Path, precision: str) -> Config:
    return make_config([*TEXT, "train.max_steps=6", f"train.precision={precision}"], tmp_path, precision)


def _train(tmp_path: Path, precision: str) -> Path:
    return Path(run_rank(_config(tmp_path, precision))["run_dir"])


def _torch_autocast_losses(cfg: Config) -> dict[str, list[float]]:
    """The run's losses by torch alone, in fp32 and under torch's bf16 autocast: its initial model and batches (from
    an fp32 trainer), AdamW with its groups and lr schedule, its clip, in a plain loop. The difference is this CPU's
    own bf16 error, which no code of gptpar's precision path takes part in."""
    trainer = make_trainer(updated(cfg, {"log.run_id": f"{cfg.log.run_id}-torch"}), CPU)  # a folder of its own
    batches = [step[0] for step in itertools.islice(trainer.batches(0, 0), trainer.total_steps)]
    losses: dict[str, list[float]] = {}
    for name in ("fp32", "bf16"):
        model = copy.deepcopy(trainer.net.model).train()
        optimizer = make_optimizer([(p, p.dim() >= 2) for p in model.parameters()], cfg.train)
        losses[name] = []
        for step, (inputs, labels) in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg.train, len(batches))
            with torch.autocast("cpu", torch.bfloat16, enabled=name == "bf16"):
                loss = lm_loss(model(inputs).logits, labels)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    return losses


@pytest.mark.slow
def test_bf16_on_a_cpu_trains_within_bf16_rounding_of_fp32_and_says_so_in_its_log(tmp_path: Path) -> None:
    fp32, bf16 = _train(tmp_path, "fp32"), _train(tmp_path, "bf16")
    fp32_log, bf16_log = _log(fp32), _log(bf16)
    assert bf16_log.header["precision"] == "bf16"
    steps = list(bf16_log.steps.values())
    losses, reference = [r["loss"] for r in steps], [r["loss"] for r in fp32_log.steps.values()]
    assert losses[-1] < losses[0] - 1.0, losses  # it trains
    torch_losses = _torch_autocast_losses(_config(tmp_path, "fp32"))
    assert torch_losses["fp32"] == pytest.approx(reference, rel=1e-5)  # the plain loop is the run
    measured = max(abs(b - f) for b, f in zip(torch_losses["bf16"], torch_losses["fp32"], strict=True))
    tolerance = max(BF16_ERROR_FLOOR, BF16_ERROR_FACTOR * measured)
    assert losses == pytest.approx(reference, abs=tolerance), measured
    assert losses != reference  # autocast ran: bf16 rounds differently from fp32
    assert bf16_log.epochs[0]["val_loss"] == pytest.approx(fp32_log.epochs[0]["val_loss"], abs=tolerance)
    assert all(r["skipped"] is False and r["loss_scale"] is None for r in steps)  # bf16 needs no loss scale


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_fp16_and_tf32_on_a_cpu_are_one_line_set_up_errors(tmp_path: Path, precision: str) -> None:
    cfg = make_config([f"train.precision={precision}"], tmp_path, precision)
    with pytest.raises(GptparError) as error:
        make_trainer(cfg, CPU)
    message = str(error.value)
    assert f"train.precision={precision}" in message and "CUDA GPU" in message and "\n" not in message


def test_the_loss_scaler_skips_an_overflow_halves_the_scale_and_grows_it_after_clean_steps() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    precision = Precision(None, torch.device("cpu"), DynamicLossScaler(scale=8.0, growth_interval=2))
    x = torch.randn(3, 4)

    def step(overflow: bool) -> bool:
        optimizer.zero_grad()
        precision.scale(model(x).square().mean()).backward()
        if overflow:
            model.weight.grad[0, 0] = math.inf
        stepped = precision.unscale(list(model.parameters()))
        if stepped:
            optimizer.step()
        return stepped

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not step(overflow=True) and precision.skipped and precision.step_scale == 8.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not optimizer.state
    assert precision.loss_scale == 4.0
    assert step(overflow=False) and not precision.skipped and precision.loss_scale == 4.0
    model.zero_grad()
    model(x).square().mean().backward()
    unscaled = model.weight.grad.clone()
    assert step(overflow=False) and precision.step_scale == 4.0 and precision.loss_scale == 8.0  # 2 clean steps
    torch.testing.assert_close(model.weight.grad, unscaled)  # the scaled backward, divided by its scale


def _poison(param: nn.Parameter, when) -> None:
    """A real gradient hook that makes `param`'s gradient all inf whenever `when()` says so."""
    param.register_hook(lambda grad: torch.full_like(grad, math.inf) if when() else None)


@pytest.mark.slow
def test_the_trainer_skips_overflowing_steps_logs_them_and_recovers(tmp_path: Path) -> None:
    """The fp16 scaler on an autocast-free fp32 model (fp16 itself needs a GPU): an inf in one gradient skips
    steps 1 and 2; the data and the lr schedule move on, the weights and the optimizer do not."""
    cfg = make_config(["train.max_steps=4"], tmp_path, "overflow")
    trainer = make_trainer(cfg, CPU)
    trainer.precision = Precision(None, CPU.device, DynamicLossScaler(growth_interval=2))
    initial = named_params(trainer)
    _poison(trainer.net.get_parameter("model.transformer.h.0.mlp.c_fc.weight"), lambda: trainer.step < 2)
    train_steps(trainer, 1)
    assert trainer.precision.skipped and trainer.precision.loss_scale == 2.0**15 and not trainer.optimizer.state
    assert all(torch.equal(p, initial[n]) for n, p in named_params(trainer).items())
    trainer.log.log("header", **header_fields(cfg, trainer.dims, 0))  # as `gptpar train` starts its log
    assert trainer.run()[0] == "completed"  # steps 2 (skipped), 3 and 4, logged
    steps = list(_log(trainer.folder.path).steps.values())
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in steps] == [
        (2, True, 2.0**15), (3, False, 2.0**14), (4, False, 2.0**14)]
    assert steps[0]["grad_norm"] == math.inf and all(math.isfinite(r["loss"]) for r in steps)
    assert [r["lr"] for r in steps] == [learning_rate(s, cfg.train, 4) for s in (1, 2, 3)]
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {2}  # two of four steps stepped
    assert trainer.precision.loss_scale == 2.0**15  # two clean steps in a row: grown
    resumed = make_trainer(cfg, CPU)
    resumed.precision = Precision(None, CPU.device, DynamicLossScaler(scale=1.0))
    assert load_checkpoint(resumed.folder.path, {"trainer": resumed}) and resumed.precision.loss_scale == 2.0**15


def test_a_one_process_pipe_runs_its_partitions_under_the_callers_autocast() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = seq(x)
        pipe = Pipe(seq, split_size=2, balance=[2, 1])
        out = pipe(x)
    assert out.dtype == torch.bfloat16  # the last partition ran in a worker thread, under autocast
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in seq.parameters())
    pipe.close()


def _parallel_worker(info: RankInfo, runs: Path) -> None:
    for name, overrides in PARALLEL_CASES:
        trainer = make_trainer(make_config([*TEXT, *overrides], runs, name), info)
        record = {"losses": train_steps(trainer, STEPS), "val": trainer.evaluate(), "params": named_params(trainer)}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    # A loss scale through the pipeline engine (with bf16: fp16 needs a GPU): the same gradient norm as without
    # one; then an overflow on the last stage only skips the step on both stages.
    cfg = make_config([*TEXT, *dict(PARALLEL_CASES)["pp2-1f1b"]], runs, "scaled")
    plain, scaled = make_trainer(updated(cfg, {"log.run_id": "plain"}), info), make_trainer(cfg, info)
    scaled.precision = Precision(torch.bfloat16, info.device, DynamicLossScaler())
    batch = next(plain.batches(0, 0))
    norms = [float(plain.train_step(batch)[1]), float(scaled.train_step(batch)[1])]
    scaled.step += 1
    before = named_params(scaled)
    if info.rank == 1:
        _poison(next(p for n, p in scaled.net.named_parameters() if ".blocks." in n), lambda: True)
    scaled.train_step(next(scaled.batches(0, 1)))
    unchanged = all(torch.equal(p, before[n]) for n, p in named_params(scaled).items())
    torch.save({"norms": norms, "skipped": scaled.precision.skipped, "unchanged": unchanged,
                "scale": scaled.precision.loss_scale}, runs / f"scaled.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("precision")
    gloo_pool.run(2, _parallel_worker, runs)
    return runs


@pytest.fixture(scope="module")
def one_process(parallel_runs: Path) -> dict[str, dict]:
    """One process on the same global batch, in bf16 and in fp32: the reference of every case, since the cases differ
    from it only in parallel.* keys, which reference_run resets."""
    assert all(key == BF16 or key.startswith("parallel.") for _, overrides in PARALLEL_CASES for key in overrides)
    return {precision: reference_run(make_config([*TEXT, f"train.precision={precision}"], parallel_runs, precision))
            for precision in ("bf16", "fp32")}


@pytest.mark.parametrize("name", [name for name, _ in PARALLEL_CASES])
@pytest.mark.slow
def test_bf16_on_two_ranks_trains_like_one_bf16_process(parallel_runs: Path, one_process: dict[str, dict],
                                                       name: str) -> None:
    ranks = [torch.load(parallel_runs / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
    ref, fp32 = one_process["bf16"], one_process["fp32"]
    # Replicas each report their shard's loss (their mean is the batch's); stages and tensor-parallel ranks the batch's.
    losses = [sum(step) / 2 for step in zip(*(r["losses"] for r in ranks), strict=True)]
    tolerance = TP_LOSS_TOL if name.startswith("tp") else PARALLEL_LOSS_TOL
    assert losses == pytest.approx(ref["losses"], abs=tolerance)
    assert losses != fp32["losses"]  # the ranks ran under autocast
    assert ranks[0]["val"] == pytest.approx(ref["val"], abs=RING_VAL_TOL if name == "cp2-ring" else tolerance)
    params = {**ranks[1]["params"], **ranks[0]["params"]}  # a pipeline: each rank holds its stages
    assert set(params) - set(TIED) == set(ref["params"])
    diff = torch.cat([(value - ref["params"][TIED.get(p, p)]).flatten() for p, value in params.items()])
    assert diff.abs().mean() < PARALLEL_PARAM_TOL


@pytest.mark.slow
def test_the_loss_scale_reaches_the_pipeline_engine_and_an_overflow_on_one_stage_skips_every_stage(
        parallel_runs: Path) -> None:
    ranks = [torch.load(parallel_runs / f"scaled.rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in ranks:
        plain, scaled = rank["norms"]
        assert scaled == pytest.approx(plain, rel=1e-3)  # scaled by 2**16 in backward, unscaled before clipping
        assert rank["skipped"] and rank["unchanged"] and rank["scale"] == 2.0**15


def test_each_step_sets_its_own_tf32_flags_so_trainers_of_two_precisions_can_share_a_process() -> None:
    tf32, fp32 = Precision(None, CPU.device, tf32=True), Precision(None, CPU.device)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        tf32.set_matmul_precision()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        fp32.set_matmul_precision()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
