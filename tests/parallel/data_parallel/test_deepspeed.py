"""DeepSpeed's engine (parallel.dp_sync=deepspeed) as a reference row: ZeRO stages 1-3 on 2 gloo ranks train like one
gptpar process, hold the ZeRO closed forms (plus DeepSpeed's fp32 master partition), resume exactly from DeepSpeed's
own checkpoints, and offload without changing a loss. The bad inputs are one line each.

One spawn of 2 ranks (the shared gloo pool; DeepSpeed does not run on threads: its communication module keeps one
process-wide state) trains each case 2 steps through the trainer's own step; the assertions compare with one process
on the same global batch at the tolerances of our ZeRO rows (test_zero.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import WORLD_TIMEOUT_S, GlooPools
from rank_training import (
    BASE,
    assert_resumed_bitwise,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    saved_ranks,
    train_steps,
)
from torch import nn

from gptpar.config import load_config
from gptpar.errors import ConfigError, GptparError
from gptpar.parallel.data_parallel.deepspeed import (
    DeepSpeedSync,
    buildable_arch_list,
    check_engine_setup,
    deepspeed_config,
    engine_sent,
)
from gptpar.parallel.process_group import RankInfo
from gptpar.run.logfile import rank_log_path, read_rank_log
from gptpar.strategies.collectives import ring_share
from gptpar.strategies.data_parallel import DP_STRATEGIES

DS = ["parallel.dp=2", "parallel.dp_sync=deepspeed", "parallel.bucket_mb=0.01"]
CASES = {
    "stage1": [*DS, "parallel.zero_stage=1"],
    "stage2-accum": [*DS, "parallel.zero_stage=2", "train.grad_accum=2"],
    "stage3": [*DS, "parallel.zero_stage=3"],
}
OFFLOADED = {  # a spawn of their own, so that each fixture stays under a minute
    "stage2-offload": [*DS, "parallel.zero_stage=2", "parallel.offload=optimizer"],
    "stage3-offload": [*DS, "parallel.zero_stage=3", "parallel.offload=params"],
}
ALL = CASES | OFFLOADED
RESUMED = ["stage2-accum", "stage3"]


def _worker(info: RankInfo, runs: Path, cases: dict[str, list[str]], resumed: list[str]) -> None:
    for name, overrides in cases.items():
        trainer = make_trainer(make_config(overrides, runs, name), info)
        trainer.sync.count_engine_sent()
        losses = train_steps(trainer, 2)
        engine = trainer.sync.engine
        timeouts = {group._get_backend(info.device).options._timeout.total_seconds()
                    for group in (engine.data_parallel_group, engine.optimizer.dp_process_group)}
        torch.save({"losses": losses, "params": named_params(trainer), "memory": trainer.memory,
                    "sent": trainer.sync.read_engine_sent(), "timeouts": timeouts}, runs / f"{name}.rank{info.rank}.pt")
    for name in resumed:  # a step, DeepSpeed's checkpoint and ours, a new trainer, a step
        resumed = resumed_run(make_config(CASES[name], runs, f"resumed-{name}"), info)
        torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    pytest.importorskip("deepspeed")  # the deepspeed extra (make install has it)
    runs = tmp_path_factory.mktemp("deepspeed")
    gloo_pool.run(2, _worker, runs, CASES, RESUMED)
    return runs


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    pytest.importorskip("deepspeed")
    runs = tmp_path_factory.mktemp("deepspeed-offload")
    gloo_pool.run(2, _worker, runs, OFFLOADED, [])
    return runs


@pytest.mark.slow
def test_deepspeeds_bytes_are_counted_by_its_own_logger_in_ring_terms(results: Path) -> None:
    """Two steps on 2 ranks: stages 1 and 2 all-reduce the fp32 gradients at every micro-step (stage 2 partitions
    them as they come) and gather the updated parameters once a step; stage 3 reduce-scatters them once a step and
    gathers the parameters for the forward and again for the backward. The all-reduces' few extra bytes are the
    gradient norm's."""
    steps, world = 2, 2
    for name, micro_steps in (("stage1", 1), ("stage2-accum", 2), ("stage3", 1)):
        for rank in saved_ranks(results, name):
            sent, whole = rank["sent"], 4 * rank["memory"]["params"]  # fp32 bytes of the whole model
            if name != "stage3":
                assert sent["all_gather"] == steps * ring_share("all_gather", whole, world), name
                assert 0 <= sent["all_reduce"] - steps * micro_steps * ring_share("all_reduce", whole, world) < 64
                continue
            assert sent["reduce_scatter"] == steps * ring_share("reduce_scatter", whole, world)
            gathers = sent["all_gather"] / (steps * ring_share("all_gather", whole, world))
            assert 2 <= gathers < 2.5, gathers  # 2.148 measured: the tied embedding is gathered again for the head


@pytest.mark.parametrize(("asked", "built"), [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
                                              ("10.0f 12.0a", "10.0;12.0"), ("7.5 8.6", "7.5 8.6"), ("", "")])
def test_an_arch_list_deepspeed_cannot_parse_is_read_as_its_family(asked: str, built: str) -> None:
    """An H200's TORCH_CUDA_ARCH_LIST=9.0a failed DeepSpeed's op builder before any op was built."""
    assert buildable_arch_list(asked) == built


def test_deepspeeds_logged_sizes_become_ring_shares_and_an_uncounted_op_is_refused() -> None:
    """deepspeed.comm's logger sizes an all-gather by its input shard and the others by their whole input."""
    logged = {"all_reduce": {100: [2, [], [], []], 8: [1, [], [], []]}, "all_gather_into_tensor": {40: [3, [], [], []]},
              "reduce_scatter_tensor": {160: [1, [], [], []]}, "barrier": {0: [4, [], [], []]}}
    assert engine_sent(logged, 4) == {"all_reduce": round(208 * 2 * 3 / 4), "all_gather": 3 * 40 * 4 * 3 // 4,
                                      "reduce_scatter": 160 * 3 // 4}
    with pytest.raises(GptparError, match="deepspeed.comm ran send, which gptpar does not count in comm_bytes"):
        engine_sent({"send": {64: [1, [], [], []]}}, 2)


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.slow
def test_deepspeed_trains_like_one_process(request: pytest.FixtureRequest, name: str) -> None:
    """Losses and parameters of one process at the tolerances of our ZeRO rows (test_zero.py); every rank the same."""
    runs = request.getfixturevalue("results" if name in CASES else "offloaded")
    ranks = saved_ranks(runs, name)
    ref = reference_run(make_config(ALL[name], runs, name))
    mean = [sum(losses) / len(ranks) for losses in zip(*(r["losses"] for r in ranks), strict=True)]
    assert mean == pytest.approx(ref["losses"], rel=1e-5)
    for param, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ref["params"][param], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, p=param: f"{name}: {p}: {m}")
        assert all(torch.equal(value, r["params"][param]) for r in ranks), param


@pytest.mark.slow
def test_deepspeeds_own_groups_time_out_as_the_world_does(results: Path) -> None:
    """DeepSpeed makes its groups (its copy of the world, over which ZeRO reduces) with dist.new_group and no timeout:
    torch's default, 30 minutes on gloo, would hold a job whose rank stopped for that long, not parallel.timeout_s
    (the pool's world's)."""
    ranks = saved_ranks(results, "stage1") + saved_ranks(results, "stage3")
    assert len(ranks) == 4 and all(rank["timeouts"] == {WORLD_TIMEOUT_S} for rank in ranks), ranks[0]["timeouts"]


@pytest.mark.slow
def test_deepspeed_writes_its_config_in_the_run_folder(results: Path) -> None:
    config = json.loads((results / "stage2-accum" / "deepspeed_config.json").read_text())
    assert config["gradient_accumulation_steps"] == 2 and config["train_batch_size"] == 8
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["zero_optimization"]["stage"] == 2
    assert config["gradient_clipping"] == 0.5 and config["optimizer"]["params"]["lr"] == 0.01


@pytest.mark.parametrize("name", ["stage2-accum", "stage3"])
@pytest.mark.slow
def test_deepspeed_memory_is_the_zero_closed_form_plus_its_master_partition(results: Path, name: str) -> None:
    """Stage 2: 4N + (4N + 8N)/W; stage 3: 16N/W; each plus the fp32 master copy of its partition DeepSpeed keeps even
    in fp32 (4N/W, the row's `master`). Its flat partitions pad each parameter group to a multiple of W (2 groups:
    under 2 * 2W elements)."""
    ranks = saved_ranks(results, name)
    world, stage = len(ranks), int(name[5])
    row = DP_STRATEGIES["deepspeed"].at_stage(stage)
    for rank in ranks:
        memory = rank["memory"]
        n = memory["params"]
        closed = row.state_bytes(n, world)
        measured = memory["params_bytes"] + memory["grads_bytes"] + memory["optimizer_bytes"]
        assert 0 <= measured - closed < 16 * 2 * 2 * world  # padding: 16 bytes an element, 2 groups of < 2W elements
        assert memory["optimizer_bytes"] == pytest.approx(8 * n / world, abs=8 * 2 * world)


@pytest.mark.parametrize(("name", "per_parameter"), [("stage2-offload", 16), ("stage3-offload", 20)])
@pytest.mark.slow
def test_offload_keeps_its_share_of_the_state_on_the_host(offloaded: Path, name: str, per_parameter: int) -> None:
    """parallel.offload=optimizer: the fp32 master partition, its gradients and AdamW's moments, (4 + 4 + 8)N/W;
    params (stage 3): this rank's parameter partition too, 20N/W, everything it holds."""
    ranks = saved_ranks(offloaded, name)
    world = len(ranks)
    for rank in ranks:
        memory = rank["memory"]
        assert 0 <= memory["host_bytes"] - per_parameter * memory["params"] / world < 16 * 2 * 2 * world


@pytest.mark.parametrize("name", RESUMED)
@pytest.mark.slow
def test_a_resumed_deepspeed_run_continues_bitwise_where_it_stopped(results: Path, name: str) -> None:
    assert_resumed_bitwise(results, name)


def test_zero_stage_with_another_sync_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^parallel.zero_stage=3 is read by parallel.dp_sync=deepspeed only"):
        load_config(None, ["parallel.dp=2", "parallel.dp_sync=zero2", "parallel.zero_stage=3"])


def test_params_offload_below_stage_3_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^parallel.offload=params needs parallel.zero_stage=3"):
        load_config(None, ["parallel.dp=2", "parallel.dp_sync=deepspeed", "parallel.zero_stage=2",
                           "parallel.offload=params"])


def test_deepspeed_with_a_pipeline_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^parallel.dp_sync=deepspeed drives its own engine, which syncs whole "
                                          r"models only; use parallel.dp_sync=naive"):
        load_config(None, ["parallel.dp=2", "parallel.pp=2", "parallel.dp_sync=deepspeed"])


def test_deepspeed_with_tensor_parallelism_is_one_line_even_on_one_replica() -> None:
    """Its engine runs over every rank (a group of one at dp=1 being the world): it would average tp's pieces."""
    with pytest.raises(ConfigError, match=r"^parallel.tp_impl=gptpar with parallel.dp=1 does not compose with "
                                          r"parallel.dp_sync=deepspeed: use parallel.dp_sync=fsdp \(ours\) instead$"):
        load_config(None, ["parallel.tp=2", "parallel.dp_sync=deepspeed"])


@pytest.mark.parametrize(("overrides", "asked"), [
    (["parallel.param_comm=int8"], "parallel.param_comm=int8"),
    (["parallel.grad_comm=int8", "parallel.hpz=true"], "parallel.grad_comm=int8 and parallel.hpz=true"),
])
def test_zero_plus_plus_on_a_cpu_is_one_line_that_says_why(overrides: list[str], asked: str) -> None:
    cfg = load_config(None, [*DS, *overrides])
    with pytest.raises(GptparError) as error:
        check_engine_setup(cfg.parallel, cfg.train, torch.device("cpu"))
    assert str(error.value) == (
        f"{asked} with parallel.dp_sync=deepspeed is ZeRO++, which DeepSpeed implements on CUDA GPUs only (its CPU "
        "backend has no quantised collectives), but this rank runs on cpu; use parallel.dp_sync=fsdp (ours), or fp32 "
        "and hpz=false")


def test_fp16_is_refused_where_it_would_run_and_bf16_is_autocast_over_fp32_weights() -> None:
    """On a GPU (the check asks no GPU for an explicit precision): DeepSpeed's fp16 is another recipe; bf16 is torch's
    autocast with fp32 gradients on the wire, as gptpar's own bf16."""
    fp16 = load_config(None, [*DS, "train.precision=fp16"])
    with pytest.raises(GptparError, match=r"^train.precision=fp16 is not built for parallel.dp_sync=deepspeed"):
        check_engine_setup(fp16.parallel, fp16.train, torch.device("cuda"))
    bf16 = load_config(None, [*DS, "train.precision=bf16"])
    precision = check_engine_setup(bf16.parallel, bf16.train, torch.device("cuda"))
    assert deepspeed_config(bf16.parallel, bf16.train, 2, precision, 1)["torch_autocast"] == {
        "enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}


def test_quantised_weights_under_bf16_are_refused_in_one_line_as_deepspeed_refuses_them() -> None:
    """On an H200 DeepSpeed 0.19.8 asserts "Cannot enable both torch autocast and zero quantized weights"."""
    cfg = load_config(None, [*DS, "parallel.param_comm=int8", "train.precision=bf16"])
    with pytest.raises(GptparError, match=r"^parallel.param_comm=int8 \(ZeRO\+\+'s quantised weights\) with "
                                          r"train.precision=bf16 is refused by DeepSpeed"):
        check_engine_setup(cfg.parallel, cfg.train, torch.device("cuda"))
    fp32 = load_config(None, [*DS, "parallel.param_comm=int8", "train.precision=fp32"])
    assert check_engine_setup(fp32.parallel, fp32.train, torch.device("cuda")) == "fp32"


def test_zero_plus_plus_and_offload_map_onto_deepspeeds_keys() -> None:
    cfg = load_config(None, [*DS, "parallel.zero_stage=3", "parallel.param_comm=int8", "parallel.grad_comm=int8",
                             "parallel.hpz=true", "parallel.offload=params"])
    zero = deepspeed_config(cfg.parallel, cfg.train, 2, "fp32", 2)["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == (
        True, True, 2)
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    plain = deepspeed_config(load_config(None, DS).parallel, cfg.train, 2, "fp32", 1)["zero_optimization"]
    assert not ({"offload_optimizer", "offload_param"} & set(plain)) and not plain["zero_quantized_weights"]


def test_deepspeed_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The import fails as it does where the extra is missing (a None in sys.modules makes `import` raise)."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    cfg = load_config(None, DS)
    with pytest.raises(GptparError) as error:
        DeepSpeedSync(nn.Linear(2, 2), dist.group.WORLD, cfg.parallel, cfg.train, torch.device("cpu"))
    assert str(error.value) == ("parallel.dp_sync=deepspeed needs the deepspeed extra: pip install "
                                "'gptpar[deepspeed]' (or make install)")


@pytest.mark.slow
def test_one_process_runs_the_engine_over_a_group_of_one_and_offloads(tmp_path: Path) -> None:
    """parallel.dp=1 (a student's one GPU, DeepSpeed offloading to the host): `gptpar train` runs the engine over a
    group of one it makes itself; the losses are one gptpar process's, and everything it holds is on the host."""
    pytest.importorskip("deepspeed")
    overrides = ["parallel.dp_sync=deepspeed", "parallel.zero_stage=3", "parallel.offload=params"]
    out = subprocess.run([sys.executable, "-m", "gptpar", "train", *BASE, *overrides, "train.max_steps=2",
                          "train.eval_every=0", "log.progress=none", f"log.runs_dir={tmp_path}", "log.run_id=alone"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = read_rank_log(rank_log_path(tmp_path / "alone", 0))
    ref = reference_run(make_config(overrides, tmp_path, "alone"))
    assert [log.steps[step]["loss"] for step in (1, 2)] == pytest.approx(ref["losses"], rel=1e-5)
    assert log.memory["host_bytes"] == 20 * log.memory["params"]  # 20N/W at W = 1: no padding
