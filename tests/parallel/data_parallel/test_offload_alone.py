"""parallel.offload on one device (parallel.dp=1, a student's one GPU): `init_distributed` joins a world of one over an
in-memory store, and the trainer builds zero1's, zero2's or fsdp2's sync over that group of one, so the host holds
what the offload moves. Each trains through the trainer's own step (AdamW, clipping on) in this process and equals
the plain one-device run, which builds no sync, to the bit where the arithmetic is the same; its memory record is
the strategy row's placed_bytes at W = 1, and a resume from its checkpoint (its host masters reloaded) continues
to the bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_training import make_config, make_trainer, named_params, resumed_run, train_steps
from unsharded_units import UnshardedUnits, priced_units

from gptpar.parallel.data_parallel.fsdp2 import FSDP2Sync
from gptpar.parallel.process_group import destroy_distributed, init_distributed
from gptpar.strategies.data_parallel import DP_STRATEGIES

STEPS = 3
OFFLOADED = {"zero1": "optimizer", "zero2": "optimizer", "fsdp2": "params"}
UNCLIPPED = ["train.grad_clip=0"]
# zero2's clip sums its gradient shard's squares per tensor over the group (clip_gradients' groups), in another order
# than the plain run's norm: the clip's factor differs in its last bits, and AdamW's division by sqrt(v) carries that
# to 9.2e-6 (measured, max abs over the parameters after 3 steps); unclipped, or with a clip that does not bite
# (train.grad_clip=100), it is equal to the bit. zero1 (whole gradients) and fsdp2 (torch's norm) are equal to the bit.
ZERO2_ATOL = 3e-5


def one_device_run(runs: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    """STEPS steps as `gptpar train` runs them without a launcher: joined (or not) by init_distributed, alone."""
    cfg = make_config(["parallel.dp=1", *overrides], runs, name)
    info = init_distributed(cfg.parallel, env={})
    try:
        joined = dist.is_initialized() and dist.get_world_size() == 1
        trainer = make_trainer(cfg, info)
        unsharded = UnshardedUnits(trainer.sync.model) if isinstance(trainer.sync, FSDP2Sync) else None
        losses = train_steps(trainer, STEPS)
        return {"losses": losses, "params": named_params(trainer), "memory": trainer.memory, "joined": joined,
                "sync": type(trainer.sync).__name__, "host": trainer.sync.host_tensors() is not None,
                "unsharded": (unsharded.peak, unsharded.most, unsharded.sizes) if unsharded else None}
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("offload-alone")
    moved = {sync: one_device_run(folder, sync, [f"parallel.dp_sync={sync}", f"parallel.offload={offload}"])
             for sync, offload in OFFLOADED.items()}
    unclipped = one_device_run(folder, "zero2-unclipped", ["parallel.dp_sync=zero2", "parallel.offload=optimizer",
                                                           *UNCLIPPED])
    accumulating = one_device_run(folder, "fsdp2-accum", ["parallel.dp_sync=fsdp2", "parallel.offload=params",
                                                         "train.grad_accum=2"])
    return moved | {"plain": one_device_run(folder, "plain", []), "zero2-unclipped": unclipped,
                    "plain-unclipped": one_device_run(folder, "plain-unclipped", UNCLIPPED),
                    "fsdp2-accum": accumulating}


def test_without_offload_one_device_joins_no_group_and_builds_no_sync(runs) -> None:
    assert (runs["plain"]["joined"], runs["plain"]["sync"], runs["plain"]["host"]) == (False, "GradSync", False)


@pytest.mark.parametrize(("name", "plain"), [("zero1", "plain"), ("fsdp2", "plain"),
                                             ("zero2-unclipped", "plain-unclipped")])
def test_an_offloaded_one_device_run_equals_the_plain_run_to_the_bit(runs, name: str, plain: str) -> None:
    moved, alone = runs[name], runs[plain]
    assert moved["joined"] and moved["host"] and moved["sync"] != "GradSync"
    assert moved["losses"] == alone["losses"]
    for param, value in alone["params"].items():
        assert torch.equal(moved["params"][param], value), param
    assert alone["losses"][-1] != alone["losses"][0]  # it trained


def test_zero2s_offloaded_clipped_run_is_the_plain_run_up_to_its_norms_order(runs) -> None:
    moved, plain = runs["zero2"], runs["plain"]
    assert moved["joined"] and moved["host"]
    assert moved["losses"] == pytest.approx(plain["losses"], rel=1e-6)  # measured: equal to the bit
    for param, value in plain["params"].items():
        torch.testing.assert_close(moved["params"][param], value, rtol=0, atol=ZERO2_ATOL, msg=param)


@pytest.mark.parametrize("dp_sync", list(OFFLOADED))
def test_an_offloaded_one_device_runs_memory_is_the_closed_form_at_one_replica(runs, dp_sync: str) -> None:
    """W = 1: zero keeps 4N + 4N on the device and puts the moments (8N), the fp32 master and its gradient (4N + 4N)
    on the host; fsdp2 puts all 16N there."""
    memory, n = runs[dp_sync]["memory"], runs["plain"]["memory"]["params"]
    device, host = DP_STRATEGIES[dp_sync].placed_bytes(n, 1, OFFLOADED[dp_sync])
    assert (device, host) == ((8 * n, 16 * n) if dp_sync != "fsdp2" else (0, 16 * n))
    assert memory["params"] == n
    assert memory["params_bytes"] + memory["grads_bytes"] + memory["optimizer_bytes"] == device
    assert memory["host_bytes"] == host
    assert "host_bytes" not in runs["plain"]["memory"]


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2-accum"])
def test_fsdp2_over_a_group_of_one_holds_unsharded_the_units_its_row_prices(runs, name: str) -> None:
    """The units copied in from the host to run (UnshardedUnits): the root's parameters and gradients, a block's and
    the reduce-scatter input of the block after it (2 + 3: a group of one makes no all-gather output, so nothing is
    prefetched); accumulating, every unit's whole gradient and the root's and a block's parameters beside them."""
    peak, most, sizes = runs[name]["unsharded"]
    assert (peak, most) == priced_units(sizes, alone=True, accumulating=name == "fsdp2-accum")
    assert sizes[2] == 4  # BASE's blocks


@pytest.mark.parametrize("dp_sync", list(OFFLOADED))
def test_an_offloaded_one_device_run_resumes_to_the_bit(tmp_path: Path, dp_sync: str) -> None:
    """One step, a checkpoint, a new trainer loaded from it and one more step: the straight run's second step."""
    overrides = ["parallel.dp=1", f"parallel.dp_sync={dp_sync}", f"parallel.offload={OFFLOADED[dp_sync]}"]
    cfg = make_config(overrides, tmp_path, "resumed")
    info = init_distributed(cfg.parallel, env={})
    try:
        straight = make_trainer(make_config(overrides, tmp_path, "straight"), info)
        losses, params = train_steps(straight, 2), named_params(straight)
        resumed = resumed_run(cfg, info)
    finally:
        destroy_distributed()
    assert resumed["losses"] == losses[1:]
    for name, value in params.items():
        assert torch.equal(resumed["params"][name], value), name
