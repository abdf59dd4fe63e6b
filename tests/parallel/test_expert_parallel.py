"""Expert parallelism (parallel.ep, gptpar/parallel/expert_parallel.py) on the shared gloo pool: every supported
data-parallel strategy trains a mixture with its experts split over ep ranks like one process (capacity 0, fp32, rel
1e-5, the load-balancing loss on), each expert's parameters equal wherever they are replicated; a checkpoint holds whole
experts, resumes exactly under its layout and loads under another ep; the all-to-all bytes and the dropped picks equal
what the routing gives; and the capacity cut, in one process, routes as transformers does when nothing is dropped and
drops each expert's top-k picks past its capacity. Mixtures inside the multi-process pipeline (EP x PP) train like one
process on the same micro-steps (a pipeline's chunks), the step record's aux_loss and expert load included, and resume
exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
    STEPS,
    as_pipeline_chunks,
    assert_trains_like_one_process,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    save_cases,
    saved_ranks,
    train_steps,
)

from gptpar.config import to_yaml
from gptpar.models import architecture
from gptpar.parallel.comm import new_step, read_sent, read_spent
from gptpar.parallel.process_group import RankInfo
from gptpar.run.folder import CONFIG_FILE
from gptpar.train.checkpoint import export_checkpoint, load_checkpoint
from gptpar.train.step_records import read_now

QWEN_MOE = ["model.preset=qwen2-moe-tiny", "model.n_embd=32", "model.n_head=4", "model.moe_aux_loss_coef=0.1"]
TABLE = "model.embed_tokens.weight"
CASES_2 = [
    ("qwen-ep2-naive", [*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=naive"]),
    ("qwen-ep2-ddp-accum", [*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=ddp",
                            "train.grad_accum=2"]),
    ("qwen-ep2-zero1", [*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=zero1"]),
    ("qwen-ep2-fsdp2", [*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=fsdp2"]),
]
# ep=2 inside dp=4: two groups of two, each expert held by two ranks (its replicas reduce its gradient); zero2 shards
# the dense gradients over all four, so the norm sums them over dp and each expert slice once.
CASES_4 = [("qwen-dp4-ep2-zero2", [*QWEN_MOE, "parallel.dp=4", "parallel.ep=2", "parallel.dp_sync=zero2"]),
           # EP x TP: attention split over tp, each tp rank running the whole mixture with its ep group's experts.
           ("qwen-tp2-ep2", [*QWEN_MOE, "parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.dp_sync=naive"]),
           # Sequence parallelism: each tp rank runs the whole mixture on its own shard of the positions; its
           # gradients are summed over tp after zero1's bucketed reduction.
           ("qwen-tp2-sp-ep2-zero1", [*QWEN_MOE, "parallel.dp=2", "parallel.tp=2", "parallel.ep=2",
                                      "parallel.sequence_parallel=true", "parallel.dp_sync=zero1"])]
MIXTRAL = ["model.preset=mixtral-tiny", "model.n_embd=32", "model.n_head=4", "model.moe_aux_loss_coef=0.1"]
# The mixture inside the multi-process pipeline: each schedule's way of running a stage's backward (whole, per model
# chunk, split into B and W); a capacity that drops picks on both stages; ep=2 inside each stage's dp=2.
PIPELINE_2 = [
    ("qwen-pp2-1f1b", [*QWEN_MOE, "parallel.pp=2", "parallel.chunks=4"]),
    ("qwen-pp2-zb1p-capacity", [*QWEN_MOE, "parallel.pp=2", "parallel.pp_schedule=zb1p", "parallel.chunks=2",
                                "train.grad_accum=2", "model.moe_capacity_factor=1"]),
    ("mixtral-pp2-interleaved", [*MIXTRAL, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                 "parallel.pp_virtual=2", "parallel.chunks=4"]),
    # Pairs: the LM loss weighs each chunk by its target tokens, the load-balancing loss each chunk equally, and
    # the padding the pipeline's fixed width adds routes but does not count.
    ("qwen-pp2-sft", [*QWEN_MOE, "parallel.pp=2", "parallel.chunks=2", "data.task=sft",
                      "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=24",
                      "data.max_target_len=24"]),
]
PIPELINE_4 = [
    ("qwen-pp2-dp2-ep2-1f1b", [*QWEN_MOE, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.chunks=2",
                               "parallel.dp_sync=naive"]),
    ("qwen-pp2-dp2-ep2-zb1p", [*QWEN_MOE, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.chunks=2",
                               "parallel.pp_schedule=zb1p", "parallel.dp_sync=bucketed"]),
]
PIPELINE_4.append(("mixtral-pp2-tp2", [*MIXTRAL, "parallel.pp=2", "parallel.tp=2", "parallel.chunks=2"]))
PIPELINE_RESUMED = "qwen-pp2-dp2-ep2-1f1b"
# The largest grid this machine holds, 5D: dp x pp x tp with sequence parallelism and ep inside dp. Each expert slice
# is held whole by the two tp ranks of its (pp, dp) place, each running it on its own sequence shard.
FIVE_D = [("qwen-dp2-pp2-tp2-sp-ep2", [*QWEN_MOE, "parallel.pp=2", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2",
                                       "parallel.sequence_parallel=true", "parallel.chunks=2",
                                       "parallel.dp_sync=naive"])]
CAPACITY = [*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", "model.moe_capacity_factor=1"]
SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=torch.device("cpu"))


def _routing_and_traffic(info: RankInfo, runs: Path, overrides: list[str]) -> None:
    """One step; saves each training forward's picks per expert and layer (the routers' own top-k), the bytes the
    step sent by all-to-all, the dropped picks its record counts, and this rank's ep coordinate."""
    trainer = make_trainer(make_config(overrides, runs, "traffic"), info)
    picks: list[torch.Tensor] = []
    for router in architecture(trainer.net.model).routers(trainer.net.model):
        router.register_forward_hook(lambda m, i, out: picks.append(torch.bincount(out[2].reshape(-1), minlength=8))
                                     if torch.is_grad_enabled() else None)
    new_step()
    train_steps(trainer, 1)
    spent = {kind: [clock.seconds() for clock in clocks] for kind, clocks in read_spent().items()}
    record = {"picks": torch.stack(picks), "sent": read_sent(), "spent": spent, "ep": trainer.dims.coord("ep"),
              "moe": read_now(trainer.router_load.step_fields())["moe"]}
    torch.save(record, runs / f"traffic.rank{info.rank}.pt")


def _resumes(info: RankInfo, runs: Path) -> None:
    """Under ep=2: a step, a checkpoint, a resumed trainer's next step; then the whole checkpoint loaded by a trainer
    of ep=1 (every rank its own copy). The same resume under zero1, whose optimizer keeps the experts' state itself,
    and under fsdp2, whose DTensor shards sit beside the plain expert slices."""
    cfg = make_config([*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=naive"], runs, "resume")
    record = resumed_run(cfg, info)
    other = make_trainer(make_config([*QWEN_MOE, "parallel.dp=2", "parallel.dp_sync=naive"], runs, "resume"), info)
    assert load_checkpoint(other.folder.path, {"trainer": other})
    record["other_ep"] = named_params(other)
    torch.save(record, runs / f"resume.rank{info.rank}.pt")
    for sync in ("zero1", "fsdp2"):
        sharded = make_config([*QWEN_MOE, "parallel.dp=2", "parallel.ep=2", f"parallel.dp_sync={sync}"], runs,
                              f"resume-{sync}")
        torch.save(resumed_run(sharded, info), runs / f"resume-{sync}.rank{info.rank}.pt")


def _pipelines(info: RankInfo, runs: Path, cases: list[tuple[str, list[str]]]) -> None:
    """Each case's steps with their mixture fields (every stage takes them from the last), parameters, place and
    validation loss; the resumed case also one step, a checkpoint and the next step of a trainer loaded from it."""
    for name, overrides in cases:
        trainer, records = make_trainer(make_config(overrides, runs, name), info), []
        record = {"losses": train_steps(trainer, STEPS, records=records), "records": records,
                  "params": named_params(trainer), "coords": dict(trainer.dims.coords), "val": trainer.evaluate()}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
        if name == PIPELINE_RESUMED:
            resumed = resumed_run(make_config(overrides, runs, f"resumed-{name}"), info)
            torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("ep")
    gloo_pool.run(2, save_cases, runs, CASES_2)
    gloo_pool.run(4, save_cases, runs, CASES_4)
    gloo_pool.run(2, _routing_and_traffic, runs, CAPACITY)
    gloo_pool.run(2, _resumes, runs)
    gloo_pool.run(2, _pipelines, runs, PIPELINE_2)
    gloo_pool.run(4, _pipelines, runs, PIPELINE_4)
    return runs


_REFERENCES: dict[tuple[str, ...], dict] = {}


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in CASES_2 + CASES_4])
def test_expert_parallelism_trains_a_mixture_like_one_process(results: Path, name: str) -> None:
    overrides = dict(CASES_2 + CASES_4)[name]
    key = tuple(o for o in overrides if not o.startswith("parallel."))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(make_config(overrides, results, name))
    ranks = saved_ranks(results, name)
    assert [r["coords"]["ep"] for r in ranks] == [r["coords"]["dp"] % 2 for r in ranks]
    # Whole parameters, experts gathered from their ep group: equal to one process's and bitwise on every rank.
    assert_trains_like_one_process(_REFERENCES[key], ranks, TABLE, name)


@pytest.fixture(scope="module")
def five_d(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    """The 8-rank case on its own (the only module that starts the 8-rank pool): `-k "not 5d"` leaves it out."""
    runs = tmp_path_factory.mktemp("ep-5d")
    gloo_pool.run(8, _pipelines, runs, FIVE_D)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in PIPELINE_2 + PIPELINE_4])
def test_a_mixture_inside_the_pipeline_trains_like_one_process(results: Path, name: str) -> None:
    """One process trained on the pipeline's micro-steps (each replica's chunk j together) is the reference: losses
    with the load-balancing term, validation, every parameter (experts gathered whole, bitwise equal on the ranks of
    a stage), and each step's aux_loss and expert load on every rank, the first stage's included."""
    _assert_pipeline_case(results, name, dict(PIPELINE_2 + PIPELINE_4)[name])


@pytest.mark.slow
def test_a_mixture_trains_on_the_5d_grid_like_one_process(five_d: Path) -> None:
    """dp=2 x pp=2 x tp=2 (sequence-parallel) with ep=2 on 8 ranks: the same equalities."""
    _assert_pipeline_case(five_d, *FIVE_D[0])


def _assert_pipeline_case(results: Path, name: str, overrides: list[str]) -> None:
    cfg = make_config(overrides, results, name)
    ref = reference_run(cfg, as_pipeline_chunks(cfg.parallel.dp, cfg.parallel.chunks))
    ranks = saved_ranks(results, name)
    assert_trains_like_one_process(ref, ranks, TABLE, name)
    for rank in ranks:
        for got, expected in zip(rank["records"], ref["records"], strict=True):
            assert got["aux_loss"] == pytest.approx(expected["aux_loss"], rel=1e-5)
            assert got["moe"] == expected["moe"]
    if "capacity" in name:  # both stages' experts dropped picks, counted once
        assert all(record["moe"]["dropped"] > 0 for record in ref["records"])


@pytest.mark.slow
def test_a_mixture_inside_the_pipeline_resumes_exactly_under_expert_parallelism(results: Path, tmp_path: Path
                                                                              ) -> None:
    """One step, a checkpoint (each stage's expert slices DTensors over its own ep group), a resumed trainer's next
    step: the uninterrupted second step, bitwise; the checkpoint exports every block's experts whole, as saved."""
    name = f"resumed-{PIPELINE_RESUMED}"
    ranks = saved_ranks(results, name)
    for rank, through in zip(ranks, saved_ranks(results, PIPELINE_RESUMED), strict=True):
        assert rank["losses"] == through["losses"][1:]
        for param, value in rank["params"].items():
            assert torch.equal(value, through["params"][param]), param
    (results / name / CONFIG_FILE).write_text(to_yaml(make_config(dict(PIPELINE_4)[PIPELINE_RESUMED], results, name)))
    state = torch.load(export_checkpoint(results / name, tmp_path / "whole.pt"), weights_only=False)["qwen2_moe"]
    saved = {param: value for rank in ranks for param, value in rank["saved"].items()}  # both stages' blocks
    for block in range(4):
        for fused in ("gate_up_proj", "down_proj"):
            param = f"model.layers.{block}.mlp.experts.{fused}"
            assert state[param].shape[0] == 8 and torch.equal(state[param], saved[param]), param


@pytest.mark.slow
def test_all_to_all_bytes_and_dropped_picks_are_what_the_routing_gives(results: Path) -> None:
    """Capacity 1 on 2 ranks of 4 experts each: per block, a rank keeps at most ceil(64 * 2 / 8) = 16 picks per
    expert of its 64 tokens, sends the kept ones for the other rank's experts and receives the other's for its own,
    forward and back, in fp32 rows of 32; backward sends as much again; plus the 4 counts each way per forward. Each
    of those five all-to-alls per block is timed once (comm_s)."""
    ranks = [torch.load(results / f"traffic.rank{r}.pt") for r in range(2)]
    capacity = 16
    kept = [r["picks"].clamp(max=capacity) for r in ranks]  # (blocks, experts)
    for me, rank in enumerate(ranks):
        mine = slice(4 * rank["ep"], 4 * rank["ep"] + 4)
        sent = sum(kept[me][:, e].sum() for e in range(8) if not mine.start <= e < mine.stop)
        received = kept[1 - me][:, mine].sum()
        rows = 2 * int(sent + received)  # dispatch and return; backward: the same rows the other way
        assert rank["sent"]["all_to_all"] == rows * 32 * 4 + 4 * 8 * len(kept[me])  # fp32 rows, int64 counts
        assert list(rank["spent"]) == ["all_to_all"] and len(rank["spent"]["all_to_all"]) == 5 * len(kept[me])
        assert all(seconds > 0 for seconds in rank["spent"]["all_to_all"])
    dropped = sum(int((r["picks"] - capacity).clamp(min=0).sum()) for r in ranks)
    assert dropped > 0 and all(r["moe"]["dropped"] == dropped for r in ranks)


@pytest.mark.slow
def test_a_checkpoint_holds_whole_experts_resumes_exactly_and_loads_under_another_ep(results: Path,
                                                                                    tmp_path: Path) -> None:
    ranks = [torch.load(results / f"resume.rank{r}.pt") for r in range(2)]
    straight = saved_ranks(results, "qwen-ep2-naive")  # the same config, two steps without a stop
    for rank, through in zip(ranks, straight, strict=True):
        assert rank["losses"] == through["losses"][1:]  # the resumed step is the uninterrupted second step
        for name, value in rank["params"].items():
            assert torch.equal(value, through["params"][name]), name
        for name, value in rank["saved"].items():
            assert torch.equal(rank["other_ep"][name], value), name  # ep=1 loaded exactly what ep=2 saved
    for sync in ("zero1", "fsdp2"):  # each resumes the experts' AdamW state too
        for rank, through in zip([torch.load(results / f"resume-{sync}.rank{r}.pt") for r in range(2)],
                                 saved_ranks(results, f"qwen-ep2-{sync}"), strict=True):
            assert rank["losses"] == through["losses"][1:], sync
            for name, value in rank["params"].items():
                assert torch.equal(value, through["params"][name]), (sync, name)
    cfg = make_config(QWEN_MOE, results, "resume")  # what `gptpar train` leaves in a run folder beside it
    (results / "resume" / CONFIG_FILE).write_text(to_yaml(cfg))
    out = export_checkpoint(results / "resume", tmp_path / "whole.pt")
    state = torch.load(out, weights_only=False)["qwen2_moe"]
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 2 * 64, 32)
    torch.testing.assert_close(state["model.layers.0.mlp.experts.gate_up_proj"],
                               ranks[0]["saved"]["model.layers.0.mlp.experts.gate_up_proj"])


def test_the_capacity_path_routes_as_transformers_does_when_nothing_is_dropped(tmp_path: Path) -> None:
    """Capacity 8 over 8 experts cannot drop a pick: gptpar's dispatch (sort, run, weigh, add back) trains as
    transformers' own experts forward does; a capacity of 0.5 drops some, and the loss moves; recomputing every block
    in backward drops (and counts) the same picks."""
    runs = {}
    recomputed = ["train.activation_checkpointing=block"]
    for factor, extra in (("0", []), ("8", []), ("0.5", []), ("0.5-recomputed", recomputed)):
        overrides = [*QWEN_MOE, f"model.moe_capacity_factor={factor.split('-')[0]}", *extra]
        trainer = make_trainer(make_config(overrides, tmp_path, factor), SINGLE)
        runs[factor] = (train_steps(trainer, 2), named_params(trainer), read_now(trainer.router_load.step_fields()))
    assert runs["8"][0] == pytest.approx(runs["0"][0], rel=1e-5)
    for name, value in runs["0"][1].items():
        torch.testing.assert_close(runs["8"][1][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert runs["0"][2]["moe"]["dropped"] == runs["8"][2]["moe"]["dropped"] == 0
    assert runs["0.5"][2]["moe"]["dropped"] > 0 and runs["0.5"][0][1] != runs["0"][0][1]
    assert runs["0.5-recomputed"][0] == pytest.approx(runs["0.5"][0], rel=1e-5)
    assert runs["0.5-recomputed"][2]["moe"]["dropped"] == runs["0.5"][2]["moe"]["dropped"]


@pytest.mark.parametrize(("top_k", "capacity"), [(1, 8), (2, 16)])
def test_the_dropped_picks_are_each_experts_top_k_picks_past_its_capacity(tmp_path: Path, top_k: int,
                                                                          capacity: int) -> None:
    """Capacity factor 0.5 over 8 experts, one micro-batch of 8 × 16 = 128 tokens: an expert keeps
    ceil(0.5 · 128 · k / 8) picks (8 for top-1, 16 for top-2), and the step record's `dropped` is, over the 4 blocks,
    each expert's picks among the routers' own top-k assignments past that (a capacity that forgot k, 8 for top-2,
    drops more)."""
    overrides = [*QWEN_MOE, "model.moe_capacity_factor=0.5", f"model.moe_top_k={top_k}"]
    trainer = make_trainer(make_config(overrides, tmp_path, f"top{top_k}"), SINGLE)
    picks: list[torch.Tensor] = []
    for router in architecture(trainer.net.model).routers(trainer.net.model):
        router.register_forward_hook(lambda m, i, out: picks.append(out[2]) if torch.is_grad_enabled() else None)
    records: list[dict] = []
    train_steps(trainer, 1, records=records)
    assert [p.shape for p in picks] == [(128, top_k)] * 4  # one training forward of every block
    past = sum(int((torch.bincount(p.reshape(-1), minlength=8) - capacity).clamp(min=0).sum()) for p in picks)
    assert past > 0 and records[0]["moe"]["dropped"] == past
