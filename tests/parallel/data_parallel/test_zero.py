"""ZeRO-1/2/3 (zero1, zero2, our fsdp) and FSDP2 on real gloo groups: one process's training, memory to the byte;
resumes of these and of the replicating syncs (naive, ddp).

One spawn of 2 ranks (and one of 4) trains each case through the trainer's own step (AdamW, clipping on) and
saves losses, parameters and the `memory` counts; the assertions compare them with one process on the same
global batch, and the memory with the closed forms 4N + 4N + 8N/W (ZeRO-1), 4N + (4N + 8N)/W (ZeRO-2) and 16N/W
(fsdp, per unit), the flat buffers' padding included.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import (
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
from unsharded_units import UnshardedUnits, priced_units

from gptpar.errors import GptparError
from gptpar.parallel.data_parallel.fsdp import FSDPSync
from gptpar.parallel.data_parallel.fsdp2 import FSDP2Sync
from gptpar.parallel.data_parallel.sharded import Unit
from gptpar.parallel.process_group import RankInfo
from gptpar.train.checkpoint import export_checkpoint

CASES = [
    ("naive", ["parallel.dp=2", "parallel.dp_sync=naive"]),  # the replicating syncs, for their resume
    ("ddp", ["parallel.dp=2", "parallel.dp_sync=ddp"]),
    ("zero1", ["parallel.dp=2", "parallel.dp_sync=zero1"]),
    ("zero1-accum", ["parallel.dp=2", "parallel.dp_sync=zero1", "train.grad_accum=2", "parallel.bucket_mb=0.01"]),
    ("zero2", ["parallel.dp=2", "parallel.dp_sync=zero2", "parallel.bucket_mb=0.01"]),
    ("zero2-accum", ["parallel.dp=2", "parallel.dp_sync=zero2", "train.grad_accum=2", "parallel.bucket_mb=0.01"]),
    ("fsdp", ["parallel.dp=2", "parallel.dp_sync=fsdp"]),
    ("fsdp-accum", ["parallel.dp=2", "parallel.dp_sync=fsdp", "train.grad_accum=2"]),
    ("fsdp-meta", ["parallel.dp=2", "parallel.dp_sync=fsdp", "model.init_device=meta"]),
    ("fsdp2", ["parallel.dp=2", "parallel.dp_sync=fsdp2"]),
    ("fsdp2-accum", ["parallel.dp=2", "parallel.dp_sync=fsdp2", "train.grad_accum=2"]),
    # parallel.offload through the trainer (before_step, the memory count) and its resume (the host masters reloaded)
    ("zero1-offload", ["parallel.dp=2", "parallel.dp_sync=zero1", "parallel.offload=optimizer"]),
    ("zero2-offload", ["parallel.dp=2", "parallel.dp_sync=zero2", "parallel.bucket_mb=0.01",
                       "parallel.offload=optimizer"]),
    ("fsdp2-offload", ["parallel.dp=2", "parallel.dp_sync=fsdp2", "parallel.offload=params"]),
]
CASES_4 = [(f"{sync}-w4", ["parallel.dp=4", f"parallel.dp_sync={sync}"])
           for sync in ("zero1", "zero2", "fsdp", "fsdp2")]
ALL = dict(CASES + CASES_4)
RESUMED = ["naive", "ddp", "zero1", "zero2", "fsdp", "fsdp2", "zero2-offload", "fsdp2-offload"]


class LiveStorage:
    """What fsdp holds in flight, measured from storage as the `memory` record's bytes are: the storages of the model's
    whole parameters (a unit's gathered buffer, 0 bytes while freed) and of the buffers their gradients view, summed
    over the distinct live ones at every module's forward, every gradient of a module's output and every parameter's
    gradient landing. A gradient buffer handed to a reduce-scatter is no longer reachable from the model; a weak
    reference to its storage sees it exactly as long as it lives (torch keeps a storage's Python object while the
    storage lives)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0
        for module in model.modules():
            module.register_forward_pre_hook(lambda *_: self.sample())
            module.register_forward_hook(self._after_forward)
        for param in self.params:
            param.register_post_accumulate_grad_hook(lambda _: self.sample())

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.sample()
        for out in output if isinstance(output, tuple) else (output,):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda _: self.sample())

    def sample(self) -> None:
        self.grads = {key: ref for key, ref in self.grads.items() if ref() is not None}
        for param in self.params:
            if param.grad is not None:
                storage = param.grad.untyped_storage()
                self.grads[id(storage)] = weakref.ref(storage)
        live = [*(p.untyped_storage() for p in self.params), *(ref() for ref in self.grads.values())]
        self.peak = max(self.peak, sum(s.nbytes() for s in {id(s): s for s in live if s is not None}.values()))


def _zero_worker(info: RankInfo, runs: Path, cases: list[tuple[str, list[str]]], resume: bool) -> None:
    for name, overrides in cases:
        cfg = make_config(overrides, runs, name)
        trainer = make_trainer(cfg, info)
        initial = named_params(trainer)
        sync = trainer.sync
        live = LiveStorage(sync.model) if isinstance(sync, FSDPSync) else None
        unsharded = UnshardedUnits(sync.model) if isinstance(sync, FSDP2Sync) else None
        losses = train_steps(trainer, 2)
        record = {"losses": losses, "params": named_params(trainer), "memory": trainer.memory, "initial": initial,
                  "live_peak": live.peak if live else None,
                  "unsharded": (unsharded.peak, unsharded.most, unsharded.sizes) if unsharded else None,
                  # elements of this rank's shards: of the one flat buffer (zero1), of every unit (zero2, fsdp)
                  "shard": sum(u.shard_size for u in sync.units) if hasattr(sync, "units") else getattr(
                      sync, "shard_size", None), "units": len(getattr(sync, "units", [None])),
                  "pieces": [(p.name, p.start, p.end) for p in getattr(sync, "pieces", [])]}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    for name in RESUMED if resume else ():  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(dict(CASES)[name], runs, f"resumed-{name}"), info)
        torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("zero")
    gloo_pool.run(2, _zero_worker, runs, CASES, True)
    gloo_pool.run(4, _zero_worker, runs, CASES_4, False)
    return runs


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.slow
def test_zero_trains_like_one_process_and_keeps_the_replicas_bitwise_equal(results: Path, name: str) -> None:
    ranks = saved_ranks(results, name)
    ref = reference_run(make_config(ALL[name], results, name))
    mean = [sum(losses) / len(ranks) for losses in zip(*(r["losses"] for r in ranks), strict=True)]
    assert mean == pytest.approx(ref["losses"], rel=1e-5)
    for param, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ref["params"][param], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, p=param: f"{name}: {p}: {m}")
        assert all(torch.equal(value, r["params"][param]) for r in ranks), param  # every rank: the same model


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero1-w4", "zero2-w4", "fsdp", "fsdp-w4"])
@pytest.mark.slow
def test_the_shards_are_disjoint_and_cover_every_parameter_once(results: Path, name: str) -> None:
    ranks = saved_ranks(results, name)
    n = ranks[0]["memory"]["params"]
    covered: dict[str, list[tuple[int, int]]] = {}
    for rank in ranks:
        for param, start, end in rank["pieces"]:
            covered.setdefault(param.removeprefix("model."), []).append((start, end))
    for param, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert ranges[-1][1] == ranks[0]["params"][param].numel(), param
    assert set(covered) == set(ranks[0]["params"])
    assert sum(e - s for rank in ranks for _, s, e in rank["pieces"]) == n


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero1-w4", "zero2-w4"])
@pytest.mark.slow
def test_memory_is_the_closed_form(results: Path, name: str) -> None:
    """ZeRO-1: 4N + 4N + 8N/W; ZeRO-2: 4N + (4N + 8N)/W; N/W is the shard, padded to a multiple of W (ZeRO-2: each
    bucket's)."""
    ranks = saved_ranks(results, name)
    world = len(ranks)
    for rank in ranks:
        n, shard, memory = rank["memory"]["params"], rank["shard"], rank["memory"]
        own = sum(e - s for _, s, e in rank["pieces"])
        assert memory["params_bytes"] == 4 * shard * world  # the flat buffer: 4N plus under 4W bytes of padding
        assert 0 <= 4 * shard * world - 4 * n < 4 * world * rank["units"]
        assert memory["grads_bytes"] == (4 * n if name.startswith("zero1") else 4 * shard)
        assert memory["optimizer_bytes"] == 8 * own and own <= shard  # 8N/W: this rank's shard only
    owned = [sum(e - s for _, s, e in r["pieces"]) for r in ranks]
    assert max(owned) - min(owned) < world * ranks[0]["units"] and sum(owned) == ranks[0]["memory"]["params"]


@pytest.mark.parametrize("name", ["zero1-offload", "zero2-offload", "fsdp2-offload"])
@pytest.mark.slow
def test_an_offloaded_runs_memory_is_the_same_state_split_between_device_and_host(results: Path, name: str) -> None:
    """Through the trainer: the device keeps what the row's placed_bytes leaves it, the host 16 bytes a value of the
    shard (zero: the moments, the fp32 master and its gradient, the shard padded to W; fsdp2: everything)."""
    sync = name.removesuffix("-offload")
    for plain, moved in zip(saved_ranks(results, sync), saved_ranks(results, name), strict=True):
        before, after = plain["memory"], moved["memory"]
        assert after["params"] == before["params"]
        if sync == "fsdp2":
            assert (after["params_bytes"], after["grads_bytes"], after["optimizer_bytes"]) == (0, 0, 0)
            assert after["host_bytes"] == before["params_bytes"] + before["grads_bytes"] + before["optimizer_bytes"]
        else:
            assert (after["params_bytes"], after["grads_bytes"]) == (before["params_bytes"], before["grads_bytes"])
            assert after["optimizer_bytes"] == 0 and "host_bytes" not in before
            assert after["host_bytes"] == before["optimizer_bytes"] + 8 * moved["shard"]


@pytest.mark.parametrize("name", RESUMED)
@pytest.mark.slow
def test_a_resumed_run_continues_bitwise_where_it_stopped(results: Path, name: str) -> None:
    """Each rank saves its own shard's optimizer state (keys name the parameter and range) and loads it back; naive
    and ddp save their replicated state once and every replica loads it."""
    assert_resumed_bitwise(results, name)


def _shard_layout(sizes: tuple[int, ...], world: int, rank: int) -> tuple[int, int, list[tuple[str, int, int, int]]]:
    """(shard size, flat buffer length, each piece's (name, start, end, at)) of rank `rank`'s Unit (zero1's layout) over
    fresh parameters of `sizes` (it re-points them at its buffer)."""
    named = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    shards = Unit(named, world, rank, torch.device("cpu"), separate_shard=False)
    return shards.shard_size, shards.full.numel(), [(p.name, p.start, p.end, p.at) for p in shards.pieces]


def test_shards_are_ceil_n_over_w_and_hold_each_element_once() -> None:
    """7 + 5 = 12 values over 3 ranks: shards of 4 and no padding, rank 1's shard p0[4:7] then p1[0:1]; 13 values:
    shards of ceil(13 / 3) = 5, the last padded with 2."""
    assert [_shard_layout((7, 5), 3, r) for r in range(3)] == [
        (4, 12, [("p0", 0, 4, 0)]), (4, 12, [("p0", 4, 7, 0), ("p1", 0, 1, 3)]), (4, 12, [("p1", 1, 5, 0)])]
    assert [_shard_layout((7, 6), 3, r)[2] for r in range(3)] == [
        [("p0", 0, 5, 0)], [("p0", 5, 7, 0), ("p1", 0, 3, 2)], [("p1", 3, 6, 0)]]
    assert _shard_layout((7, 6), 3, 2)[:2] == (5, 15)


def test_zero1_with_a_pipeline_is_a_one_line_error() -> None:
    with pytest.raises(GptparError, match="^parallel.dp_sync=zero1 does not shard pipeline stages yet"):
        make_config(["parallel.pp=2", "parallel.chunks=2", "parallel.dp_sync=zero1"], Path("/tmp"), "x")


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2-w4"])
@pytest.mark.slow
def test_fsdp2_holds_a_shard_of_everything(results: Path, name: str) -> None:
    """FSDP2: parameters, gradients and AdamW state all sharded on dim 0, each parameter padded to W rows:
    per rank 4 + 4 + 8 bytes for each of sum_p ceil(rows_p / W) * row_size_p elements, about 16N/W."""
    ranks = saved_ranks(results, name)
    world = len(ranks)
    padded = sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in ranks[0]["params"].values())
    n = sum(p.numel() for p in ranks[0]["params"].values())
    assert n <= world * padded < n + world * sum(p.numel() // p.shape[0] for p in ranks[0]["params"].values())
    for rank in ranks:
        memory = rank["memory"]
        assert memory["params"] == n  # DTensors count their global size
        assert (memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]) == (
            4 * padded, 4 * padded, 8 * padded)


@pytest.mark.parametrize("name", ["zero1", "fsdp", "fsdp2"])
@pytest.mark.slow
def test_export_consolidates_a_sharded_checkpoint_into_whole_tensors(results: Path, name: str, tmp_path: Path) -> None:
    """`gptpar checkpoint export` (one process) writes every parameter whole, whatever shards the ranks saved
    (fsdp: every rank's pieces of each parameter, joined), also under GPT2LMHeadModel's names, there with the token
    table's padding cut off."""
    saved = saved_ranks(results, f"resumed-{name}")[0]["saved"]
    exported = torch.load(export_checkpoint(results / f"resumed-{name}", tmp_path / "plain.pt"), weights_only=False)
    model = {k.removeprefix("model."): v for k, v in exported["trainer"]["model"].items()}
    vocab = exported["trainer"]["vocab_size"]
    for param, value in saved.items():
        assert torch.equal(model[param], value), param
        whole = value[:vocab] if param == "transformer.wte.weight" else value
        assert torch.equal(exported["gpt2"][param], whole), param


def _units(params: dict[str, torch.Tensor], world: int) -> tuple[int, int, int]:
    """fsdp's layout of the test model: (root elements padded to a multiple of W, one block's padded, blocks)."""
    pad = lambda n: -(-n // world) * world  # noqa: E731
    blocks = {name.split(".")[2] for name in params if name.startswith("transformer.h.")}
    block = sum(p.numel() for name, p in params.items() if name.startswith("transformer.h.0."))
    root = sum(p.numel() for name, p in params.items() if not name.startswith("transformer.h."))
    return pad(root), pad(block), len(blocks)


@pytest.mark.parametrize("name", ["fsdp", "fsdp-accum", "fsdp-meta", "fsdp-w4"])
@pytest.mark.slow
def test_fsdp_holds_16n_over_w_and_its_in_flight_units_are_the_closed_form(results: Path, name: str) -> None:
    """Per rank: 4 bytes of parameter shard and 4 of gradient shard per element of every unit's padded shard, 8 of AdamW
    state per element it owns; in flight at most the root's parameters and flat gradient plus four block buffers
    (two gathered, two flat gradients: one accumulating, one reduce-scattering), with or without accumulation: what
    `gathered_peak_bytes` counts and what the live storages measured during the steps (LiveStorage) reach."""
    ranks = saved_ranks(results, name)
    world = len(ranks)
    root, block, blocks = _units(ranks[0]["params"], world)
    shard = (root + block * blocks) // world
    for rank in ranks:
        memory, own = rank["memory"], sum(e - s for _, s, e in rank["pieces"])
        assert memory["params"] == sum(p.numel() for p in rank["params"].values())
        assert (memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]) == (
            4 * shard, 4 * shard, 8 * own)
        assert 16 * memory["params"] / world <= sum(memory[k] for k in ("params_bytes", "grads_bytes",
                                                                         "optimizer_bytes")) < (
            16 * memory["params"] / world + 8 * (blocks + 1))
        assert memory["gathered_peak_bytes"] == rank["live_peak"] == 4 * (2 * root + 4 * block)


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2-accum", "fsdp2-offload", "fsdp2-w4"])
@pytest.mark.slow
def test_fsdp2_holds_unsharded_at_once_the_units_its_row_prices(results: Path, name: str) -> None:
    """What torch's fully_shard held unsharded during the steps (UnshardedUnits: parameters, gradients, all-gather
    outputs and reduce-scatter inputs, counted in units) is what the fsdp2 row prices (`in_flight`, which the planner
    reads): 2 root and 4 block units at the peak, with offload=params (the host's shards copied in) too;
    accumulating, every unit's whole gradient kept between micro-steps and beside it 2 + 1 (a later micro-step's first
    gathers, the peak here: the root outweighs a block) or 1 + 2 (the last micro-step's backward) at most."""
    for rank in saved_ranks(results, name):
        peak, most, sizes = rank["unsharded"]
        assert (peak, most) == priced_units(sizes, alone=False, accumulating=name == "fsdp2-accum")
        assert sizes[2] == 4  # BASE's blocks: one before and one after a middle block's backward


@pytest.mark.slow
def test_deferred_initialisation_materialises_the_same_model_as_a_normal_build(results: Path) -> None:
    """model.init_device=meta under fsdp: each rank materialises only its shards, from per-parameter seeds, and the
    gathered model equals a normal build's, as its training equals one process's (the equality test above)."""
    meta, normal = saved_ranks(results, "fsdp-meta"), saved_ranks(results, "fsdp")
    for m, n in zip(meta, normal, strict=True):
        assert m["initial"].keys() == n["initial"].keys()
        for param, value in n["initial"].items():
            assert torch.equal(m["initial"][param], value), param
