"""A calibration's lookups (the rate interpolated over log FLOPs, the links fitted in ring terms), its checks against
the device and torch it predicts for, and the pieces the planner counts without torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planfix import calibration, layout

from gptpar.errors import GptparError
from gptpar.plan.calibration import _fit, check_fits, load, same_device
from gptpar.strategies.collectives import ring_share


def test_compute_rates_are_interpolated_over_log_flops_and_held_flat_past_the_ends() -> None:
    calib = calibration(layout("model.preset=gpt2-tiny"))
    calib.compute["block_f"] = [[1e6, 1e-3], [1e8, 1e-2]]  # 1 and 10 GFLOP/s
    assert calib.seconds("block_f", 1e7) == pytest.approx(1e7 / 5.5e9)  # halfway in log FLOPs: the mean rate
    assert calib.seconds("block_f", 1e5) == pytest.approx(1e-4)  # the smallest point's rate
    assert calib.seconds("block_f", 1e9) == pytest.approx(0.1)  # the largest point's rate
    calib.compute_alone["block_f"] = [[1e6, 5e-4]]  # one rank alone on the machine: twice as fast
    assert calib.seconds("block_f", 1e6, alone=True) == pytest.approx(5e-4)
    assert calib.seconds("block_w", 1e6, alone=True) == calib.seconds("block_w", 1e6)  # none measured alone


def test_a_link_is_fitted_as_latency_per_step_plus_ring_share_over_bandwidth() -> None:
    latency, bandwidth = 2e-4, 5e8
    for op in ("all_reduce", "all_gather", "send_recv"):
        steps = {"all_reduce": 2, "all_gather": 1, "send_recv": 1}[op]
        share = (lambda n: float(n)) if op == "send_recv" else (lambda n, op=op: ring_share(op, n, 2))
        points = [(n, steps * latency + share(n) / bandwidth) for n in (4096, 65536, 2**20, 2**24)]
        fit = _fit(points, op, 2)
        assert fit.latency_s == pytest.approx(latency, rel=1e-6)
        assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
        # priced over 8 ranks: 2(g-1) or g-1 steps, the ring share of 8
        if op == "all_reduce":
            assert fit.seconds(op, 2**20, 8) == pytest.approx(14 * latency + 2 * 7 / 8 * 2**20 / bandwidth)


def test_the_planner_counts_bytes_in_the_syncs_own_ring_terms() -> None:
    from gptpar.parallel import comm

    assert comm.ring_share is ring_share  # one function: a predicted byte is a counted byte


def test_a_calibration_of_another_device_or_torch_is_refused_in_one_line(tmp_path: Path) -> None:
    calib = calibration(layout(), device_name="Tesla V100-SXM2-32GB", torch_version="2.11.0+cu128")
    assert same_device(calib.device_name, "v100-32") and not same_device(calib.device_name, "a100")
    with pytest.raises(GptparError, match=r"^--calibration 'c.json' was made on 'Tesla V100-SXM2-32GB', but this "
                                          r"layout runs on 'a100'; run `python -m gptpar plan calibrate"):
        check_fits(calib, "c.json", "a100", None)
    with pytest.raises(GptparError, match=r"made with torch 2.11.0\+cu128, but torch 2.13.0\+cpu is installed"):
        check_fits(calib, "c.json", "v100-32", "2.13.0+cpu")
    check_fits(calib, "c.json", "v100-32", "2.11.0")  # the same release, another build tag: fine
    file = tmp_path / "c.json"
    file.write_text(calib.to_json())
    assert load(file) == calib
    file.write_text(json.dumps({**json.loads(calib.to_json()), "compute": {}}))
    with pytest.raises(GptparError, match="lacks block_f, block_b, block_w, head_f, head_bw, optimizer; run"):
        load(file)
    file.write_text("not json")
    with pytest.raises(GptparError, match=r"is not a calibration \(.*\); run `python -m gptpar plan calibrate"):
        load(file)


def test_rank_parameters_follow_gpt2s_own_count_over_tp_and_pp() -> None:
    d, v, positions = 256, 4096, 512
    block = 12 * d * d + 13 * d  # GPT-2's block: 4d^2 attention, 8d^2 MLP, their biases and two layer norms
    assert layout("model.preset=gpt2-mini").rank_parameters(0) == v * d + positions * d + 6 * block + 2 * d
    # tp=2: the matrices and the column-parallel biases split, the norms and the row-parallel output biases whole
    split = (block - 6 * d) // 2 + 6 * d
    assert layout("model.preset=gpt2-mini", "parallel.tp=2").rank_parameters(0) == (
        v // 2 * d + positions * d + 6 * split + 2 * d)
    # pp=2: the last stage holds a copy of the table as its LM head
    staged = layout("model.preset=gpt2-mini", "parallel.pp=2")
    assert [staged.rank_parameters(r) for r in (0, 1)] == [v * d + positions * d + 3 * block, 3 * block + 2 * d + v * d]


@pytest.mark.parametrize("hidden", ["", "-1", " "])
def test_gpus_hidden_by_cuda_visible_devices_are_not_this_machines_device(hidden: str) -> None:
    """A job that hides every GPU trains on the CPU (torch sees none), so the planner must not price a GPU; the rule
    only shows a GPU that torch would use."""
    from gptpar.plan.target import gpus_hidden

    assert gpus_hidden({"CUDA_VISIBLE_DEVICES": hidden})
    assert not gpus_hidden({}) and not gpus_hidden({"CUDA_VISIBLE_DEVICES": "0"})
