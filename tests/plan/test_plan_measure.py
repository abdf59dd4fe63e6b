"""A real calibration, tiny (one shape, one micro-batch, two sizes of each collective), on the shared 2-rank gloo
pool: every kind of compute (our tensor-parallel block and the context-parallel block of each implementation on both
ranks too) and every collective is measured, and the file reads back as a calibration of this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from manual_clock import ManualClock

from gptpar.plan.calibration import (
    COLLECTIVES,
    COMPUTE_KINDS,
    RECOMPUTED,
    cp_kind,
    load,
    local_device_name,
    tp_kind,
)
from gptpar.plan.layout import block_flops
from gptpar.plan.measure import Probes, _timer, calibrate, load_warning, measure_rank
from gptpar.presets import ModelShape

TINY = Probes(((64, 2),), ((2, 32),), (4096, 262144), (10**4, 10**5), 512, 2, comm_iters=3)


@pytest.mark.slow
def test_a_tiny_calibration_on_two_gloo_ranks(gloo_pool: GlooPools, tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    gloo_pool.run(2, measure_rank, TINY, "fp32", 1, out)
    calib = load(out)
    assert (calib.device, calib.device_name, calib.backend, calib.world_size, calib.threads) == (
        "cpu", local_device_name(), "gloo", 2, 1)
    assert all(s > 0 for kind in COMPUTE_KINDS for _, s in calib.compute[kind])
    assert all(s > 0 for kind in COMPUTE_KINDS for _, s in calib.compute_alone[kind])  # rank 0 alone, first
    for kind in ("optimizer", "optimizer_grouped"):  # torch's clip, and the per-tensor one of stages and shards
        assert [x for x, _ in calib.compute[kind]] == [1e4, 1e5]
    assert calib.compute["block_f_counted"][0][1] > 0  # the forward as the pipeline engine runs it
    assert all(calib.compute[kind][0][1] > 0 for kind in RECOMPUTED)  # a block under activation checkpointing
    for kind in ("block_f", "block_b", "block_w"):  # our tp=2 block, timed whole with and without SP
        assert all(len(calib.compute[tp_kind(kind, 2, sp)]) == 1 for sp in (False, True))
    for kind in ("head_f", "head_bw"):  # and its head and loss, with and without loss parallelism
        assert all(len(calib.compute[tp_kind(kind, 2, sp, lp)]) == 1 for sp in (False, True) for lp in (False, True))
    # the cp=2 block of each implementation, timed whole on its rank's 2 x 16 tokens of the 2 x 32 micro-batch
    cp_flops = block_flops(ModelShape("gpt2", 1, 64, 2, 1024), 2 * 32 // 2, 32)
    for impl in ("ring", "all_to_all"):
        for kind, flops in zip(("block_f", "block_b", "block_w"), cp_flops, strict=True):
            [(x, s)] = calib.compute[cp_kind(kind, 2, impl)]
            assert x == flops and s > 0
    for op in COLLECTIVES:
        (small, t_small), (big, t_big) = calib.collectives[op]
        assert (small, big) == (4096.0, 262144.0) and t_small > 0 and t_big > 0
        fit = calib.link(op)
        assert fit is not None and fit.bandwidth > 0 and fit.latency_s > 0
    # A block saves activations of the order of tens of values per token and unit of width (fp32: ~100 bytes).
    assert 20 < calib.activation_bytes_per_token_width < 1000


def test_a_piece_costs_its_median_call_and_synced_work_its_mean() -> None:
    """A step is a sum of many pieces, so each is priced at its typical call: the sum of each piece's luckiest call
    is faster than any step. Work with collectives between its computations is priced at its mean wait. The pieces
    move an injected clock by exact seconds, so the figures are exact."""
    clock = ManualClock()

    def piece() -> None:
        clock.advance(next(calls))

    calls = iter([0.5, 3.0, 0.25, 1.25])  # the first call is the untimed warm-up
    # the median, not the fastest (0.25), nor the median with the warm-up (0.875)
    assert _timer(torch.device("cpu"), 3, now=clock)(piece) == 1.25
    calls = iter([0.5, 3.0, 0.25, 1.25])
    assert _timer(torch.device("cpu"), 3, synced=True, now=clock)(piece) == 1.5  # the mean, not 1.25 with the warm-up


def test_a_calibration_says_each_piece_and_warns_once_on_a_loaded_machine(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A login node's calibration takes minutes: a line per piece; and a machine busy with other work (a load average
    above half its CPUs) makes the timings meaningless: one line says so first."""
    calibrate(tmp_path / "c.json", world=1, precision="fp32", threads=1, probes=TINY, load=(6.0, 4))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("warning: this machine's load average is 6.0 on 4 CPU(s): other work shares it, so these "
                        "timings measure that work too; calibrate on an idle node (inside an allocation, e.g. srun)")
    assert [line.rsplit(" (", 1)[0] for line in lines[1:]] == [
        "calibrate: a block of width 64, micro-batch 2x32, 1 rank(s) at once", "calibrate: the optimizer step, 1 "
        "rank(s) at once"]
    assert load_warning(2.0, 4) is None and load_warning(2.1, 4) is not None
