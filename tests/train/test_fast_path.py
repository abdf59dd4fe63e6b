"""The training step's fast path: each option trains as the plain path does (fp32: rel 1e-5), and the log header
records what it resolved to. One process, the trainer's own step (`Trainer.train_step`), tiny models."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from manual_clock import ManualClock
from rank_training import make_config, make_trainer, named_params, train_steps

import gptpar
from gptpar.clock import DeviceClock
from gptpar.config import ModelConfig
from gptpar.errors import GptparError
from gptpar.models.build import build_model, pad_vocabulary
from gptpar.models.loss import chunked_lm_loss, lm_loss
from gptpar.parallel.comm import new_step, read_spent, timed
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.tensor_parallel.layers import check_vocab_split
from gptpar.tensor_bytes import saved_activation_bytes
from gptpar.train.entry import run_rank
from gptpar.train.optim import kind_of
from gptpar.train.precision import resolve_precision
from gptpar.train.provenance import header_fields
from gptpar.train.step_records import PendingStep, PendingSteps, Spans, read_now

SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=torch.device("cpu"))
STEPS = 3
MIXTURE = ["model.preset=qwen2-moe-tiny", "model.n_embd=32", "model.n_head=4"]


def trained(tmp_path: Path, name: str, overrides: list[str]) -> tuple[list[float], dict[str, torch.Tensor], object]:
    """STEPS steps of one process: losses, parameters by GPT-2 name, the trainer."""
    trainer = make_trainer(make_config(overrides, tmp_path, name), SINGLE)
    return train_steps(trainer, STEPS), named_params(trainer), trainer


def assert_same_training(got: tuple, want: tuple) -> None:
    """Losses within fp32 rounding; parameters within a small share of one AdamW step (lr 0.01): attention's key bias
    has a gradient of pure rounding noise (softmax ignores it), which Adam divides by its own size."""
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, param in want[1].items():
        torch.testing.assert_close(got[1][name], param, rtol=1e-5, atol=5e-5, msg=name)


def test_fused_adamw_trains_as_the_plain_optimizer(tmp_path: Path) -> None:
    fused = trained(tmp_path, "fused", ["train.fused_optimizer=true"])
    plain = trained(tmp_path, "plain", ["train.fused_optimizer=false"])
    assert kind_of(fused[2].optimizer) == "fused" and fused[2].fast_path()["optimizer"] == "fused"
    assert kind_of(plain[2].optimizer) == "for-loop"  # torch's own choice on a CPU
    assert_same_training(fused, plain)


def test_a_padded_vocabulary_trains_as_the_unpadded_model(tmp_path: Path) -> None:
    """300 tokens padded to 320 rows: the real rows start and train as the unpadded table's, the padded ones stay
    zero (never in the loss, no gradient)."""
    padded = trained(tmp_path, "padded", ["model.pad_vocab=64"])
    plain = trained(tmp_path, "plain", ["model.pad_vocab=1"])
    table = padded[1]["transformer.wte.weight"]
    assert table.shape[0] == 320 and plain[1]["transformer.wte.weight"].shape[0] == 300
    assert not table[300:].any()
    padded[1]["transformer.wte.weight"] = table[:300]
    assert_same_training(padded, plain)


def test_padded_logits_never_win_and_the_real_rows_are_the_unpadded_draw() -> None:
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=2)
    padded, plain = build_model(cfg, 301, seed=3), build_model(replace(cfg, pad_vocab=1), 301, seed=3)
    assert torch.equal(padded.transformer.wte.weight[:301], plain.transformer.wte.weight)
    assert padded.lm_head.weight is padded.transformer.wte.weight  # still tied
    ids = torch.randint(0, 301, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = padded(ids).logits
    assert logits.shape[-1] == 320 and torch.isneginf(logits[..., 301:]).all()
    torch.testing.assert_close(logits[..., :301], plain(ids).logits)
    # A pretrained model (real weights) is padded the same way, after the fact.
    repadded = pad_vocabulary(build_model(replace(cfg, pad_vocab=1), 301, seed=3), 64)
    assert torch.equal(repadded.transformer.wte.weight, padded.transformer.wte.weight)
    assert repadded.lm_head.weight is repadded.transformer.wte.weight
    torch.testing.assert_close(repadded(ids).logits, logits)


def test_tensor_parallelism_and_pad_vocab_agree_on_one_padded_size() -> None:
    """The table is padded once, to a multiple of both (the vocabulary-parallel layers then split it as it is)."""
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=2)
    assert build_model(cfg, 301, seed=0, shards=3, init_device="meta").config.vocab_size == 384  # lcm(64, 3) = 192
    assert build_model(replace(cfg, pad_vocab=1), 301, seed=0, shards=2, init_device="meta").config.vocab_size == 302
    with pytest.raises(GptparError, match=r"301 rows do not split into parallel.tp=2 equal pieces; .*shards=2"):
        check_vocab_split(301, 2)


@pytest.mark.slow  # the header asks git for the commit
def test_precision_auto_is_fp32_on_a_cpu_and_the_header_records_it(tmp_path: Path) -> None:
    auto = trained(tmp_path, "auto", ["train.precision=auto"])
    fp32 = trained(tmp_path, "fp32", ["train.precision=fp32"])
    assert auto[2].precision.name == "fp32" and auto[2].precision.dtype is None
    assert auto[0] == fp32[0]  # the same step exactly
    header = header_fields(auto[2].cfg, auto[2].dims, 0)
    assert header["precision"] == "fp32" and header["config"]["train"]["precision"] == "auto"
    assert "; fp32; " in auto[2].banner()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_precision_auto_on_a_gpu_is_bf16_where_it_has_bf16_else_fp16() -> None:
    device = torch.device("cuda", 0)
    major, _ = torch.cuda.get_device_capability(device)
    assert resolve_precision("auto", device) == ("bf16" if major >= 8 else "fp16")
    assert resolve_precision("fp32", device) == "fp32"


def records(run_dir: Path, *kinds: str) -> list[dict]:
    lines = (run_dir / "rank0.jsonl").read_text().splitlines()
    return [r for line in lines if (r := json.loads(line))["kind"] in kinds]


@pytest.mark.slow  # run_rank's header asks git for the commit
def test_steps_read_back_every_sync_every_steps_still_log_every_step_in_order(tmp_path: Path) -> None:
    """log.sync_every=3 over 7 steps with an evaluation every 2: every step's record, in order, each evaluation after
    its step's record, the same numbers as reading every step back. A mixture of experts, whose expert load the step
    leaves on the device too (OnDevice fields)."""
    runs = {}
    for every in (1, 3):
        cfg = make_config([*MIXTURE, f"log.sync_every={every}", "train.max_steps=7", "train.eval_every=2",
                           "log.progress=none"], tmp_path, f"sync{every}")
        result = run_rank(cfg)
        runs[every] = Path(result["run_dir"])
        assert result["status"] == "completed"
    order = [(r["kind"], r["step"]) for r in records(runs[3], "step", "eval")]
    assert order == [(r["kind"], r["step"]) for r in records(runs[1], "step", "eval")]
    assert [s for kind, s in order if kind == "step"] == list(range(1, 8))
    assert [s for kind, s in order if kind == "eval"] == [2, 4, 6]
    assert all(order.index(("step", s)) < order.index(("eval", s)) for s in (2, 4, 6))
    steps = {every: records(run, "step") for every, run in runs.items()}
    for field in ("loss", "global_loss", "grad_norm", "lr", "aux_loss", "moe"):
        assert [r[field] for r in steps[3]] == [r[field] for r in steps[1]], field
    # Every step routes its 128 tokens to top-2 of 8 experts in each layer: 32 each on average.
    assert [r["moe"]["tokens_per_expert"]["mean"] for r in steps[3]] == [128 * 2 / 8] * 7
    assert records(runs[3], "header")[0]["fast_path"]["sync_every"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_gives_the_plain_loss_and_gradients_and_keeps_no_fp32_logits(dtype: torch.dtype) -> None:
    """Several chunks, -100 targets (translation's source positions) and -inf padded columns: the plain loss's value
    and logits gradient (fp32: rel 1e-5; bf16: each rounded once from the same fp32 numbers), while autograd keeps
    the logits as they are (bf16: half the bytes of the plain loss's fp32 log-probabilities)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, 70, generator=gen).to(dtype)
    logits[..., 64:] = float("-inf")
    targets = torch.randint(0, 64, (3, 8), generator=gen)
    targets[0, :5] = -100
    grads, losses, saved = [], [], []
    for loss_fn in (lm_loss, lambda x, y: chunked_lm_loss(x, y, chunk_elements=5 * 70)):
        x = logits.clone().requires_grad_()
        saved.append(saved_activation_bytes(lambda x=x, f=loss_fn: f(x, targets), []))
        loss = loss_fn(x, targets)
        (0.5 * loss).backward()  # a divisor (gradient accumulation) or a loss scale reaches the gradient
        losses.append(loss.item())
        grads.append(x.grad)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert grads[1].dtype == dtype and not grads[1][..., 64:].any() and not grads[1][0, :5].any()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-7)
    if dtype == torch.bfloat16:
        assert saved[1] < 0.6 * saved[0], saved


def test_the_chunked_loss_trains_as_the_plain_one(tmp_path: Path) -> None:
    chunked = trained(tmp_path, "chunked", ["train.loss_kernel=chunked"])
    plain = trained(tmp_path, "plain", ["train.loss_kernel=plain"])
    assert chunked[2].fast_path()["loss"] == "chunked" and plain[2].fast_path()["loss"] == "plain"
    assert_same_training(chunked, plain)


@pytest.mark.slow  # inductor compiles the model in a worker process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_the_default_step_on_a_gpu_never_waits_for_the_gpu(tmp_path: Path) -> None:
    """torch.cuda.set_sync_debug_mode("error") raises on any operation that makes the host wait for the device: none
    runs in gptpar's default step (bf16 there, so no fp16 overflow check), once compiled and warmed up."""
    device = torch.device("cuda", 0)
    info = replace(SINGLE, backend="nccl", device=device)
    trainer = make_trainer(make_config([], tmp_path, "no-sync"), info)
    batches = trainer.batches(0, 0)
    trainer.train_step(next(batches))  # compiles, creates the optimizer state, counts the memory once
    trainer.step += 1
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            trainer.train_step(next(batches))
            trainer.step += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_a_mixtures_step_on_a_gpu_waits_only_inside_its_libraries(tmp_path: Path) -> None:
    """A mixture's step does wait for the GPU, in its libraries: transformers' check for packed rows in the attention
    mask and torch's grouped matrix product of the experts (an H100 with torch 2.11 named those lines); no line of
    gptpar's, the routing statistics and the load-balancing loss included (they stay on the device until the fetch)."""
    info = replace(SINGLE, backend="nccl", device=torch.device("cuda", 0))
    trainer = make_trainer(make_config(MIXTURE, tmp_path, "no-sync"), info)
    batches = trainer.batches(0, 0)
    trainer.train_step(next(batches))
    trainer.step += 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step(next(batches))
            fields = trainer.router_load.step_fields()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ours = Path(gptpar.__file__).parent
    waits = {f"{w.filename}:{w.lineno}" for w in caught if "ynchroniz" in str(w.message)}
    assert waits and not [w for w in waits if w.startswith(str(ours))], sorted(waits)
    assert read_now(fields)["moe"]["tokens_per_expert"]["mean"] > 0  # the fetch: where the numbers are read


def test_a_steps_timed_collectives_are_summed_into_its_record_at_the_fetch() -> None:
    """`comm_s`: every span a step's collectives spent under gptpar.parallel.comm.timed, summed by kind when the
    step's record is fetched; the next step starts with none (an evaluation between steps counts in neither)."""
    cpu, clock = torch.device("cpu"), ManualClock()
    new_step()
    for seconds in (0.25, 0.5, 1.0):
        with timed("all_to_all", cpu, now=clock):
            clock.advance(seconds)
    spans = read_spent()
    with timed("all_to_all", cpu, now=clock):  # between steps
        clock.advance(2.0)
    new_step()
    assert read_spent() == {}
    pending = PendingSteps()
    clock = DeviceClock(cpu)
    clock.stop()
    pending.add(PendingStep(torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64), clock,
                            {"step": 1, "epoch": 0, "lr": 0.1, "skipped": False, "loss_scale": None, "tokens": 8,
                             "data_time_s": 0.0, "peak_mem_bytes": 0, "bubble": None, "comm_s": Spans(spans)}))
    (record,) = pending.fetch()
    assert record.comm_s == {"all_to_all": 1.75}
