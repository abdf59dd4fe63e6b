"""`gptpar plan search`'s last tier: where nothing fits the GPUs without it, layouts whose sync keeps parallel.offload's
parts on the host, held to the strategy table's device/host split (`placed_bytes`), to the node's host memory where
the profile names it, and written into the sweep file. gpt2-xl (1.48e9 parameters, tied) at 8 x 1,024 tokens on one
16 GB GPU, on a synthetic calibration: no layout of whole sequences fits (the least needs 24.4 GB, 16N of state and
recomputed activations), zero1's offload=optimizer needs 12.5 GB there (8N) and 23.7 GB (16N) on the host."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from planfix import calibration, layout

from gptpar.cli import main
from gptpar.launch.sweep import build_points
from gptpar.plan.commands import MB
from gptpar.plan.search import Ranked, evaluate, search
from gptpar.plan.target import target_of
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.user_defaults import resolve_config

WORDS = ["model.preset=gpt2-xl", "data.source=synthetic", "data.seq_len=1024", "train.precision=fp32",
         "train.batch_size=8"]


def files(tmp_path: Path, gpu_gb: float, per_node: int = 8, host_gb: float | str | None = None) -> tuple[str, str]:
    """A profile of `gpu_gb` GPUs (`per_node` a node, `host_gb` of host memory a node where given) and a calibration
    of its device: (profile path, calibration path)."""
    profile = tmp_path / "v100.yaml"
    host = f"  host_memory_GB: {host_gb}\n" if host_gb is not None else ""
    profile.write_text(f"device: testgpu\ngpu_type: testgpu\nlinks:\n  gpu_memory_GB: {gpu_gb}\n{host}"
                       f"  gpus_per_node: {per_node}\n"
                       "  intra_node: {bandwidth_GBps: 100, latency_us: 5, source: test}\n"
                       "  inter_node: {bandwidth_GBps: 10, latency_us: 10, source: test}\n")
    calib = tmp_path / "gpu.json"
    calib.write_text(calibration(layout(*WORDS), device_name="TestGPU 16GB").to_json())
    return str(profile), str(calib)


def searched(profile: str, calib: str) -> tuple[list[Ranked], dict[str, int]]:
    cfg = resolve_config(None, [*WORDS, f"launch.profile={profile}"], user=False)[0]
    ranked, reasons, _ = search(cfg, 1, calib)
    return ranked, dict(reasons)


def offload_of(r: Ranked) -> str:
    return str(r.overrides.get("parallel.offload", "none"))


def test_what_fits_one_gpu_only_offloaded_is_proposed_with_the_devices_bytes(tmp_path: Path) -> None:
    ranked, reasons = searched(*files(tmp_path, gpu_gb=16))
    assert ranked and all(offload_of(r) != "none" for r in ranked)
    assert any("GB per GPU, over the 16 GB a GPU holds" in reason for reason in reasons)  # the plain tier, tried first
    best = ranked[0]  # fsdp2's offload=params copies each unit in, for each micro-step: slower
    assert offload_of(best) == "optimizer" and best.layout.dp == 1 and best.layout.dp_sync in ("zero1", "zero2")
    # fsdp2's device holds its unsharded units: without recomputation (15.8 GB of activations at grad_accum=4, all it
    # had counted, its state being 0 there: it used to be proposed first) the whole gradient (4N, 5.9 GB) and a root
    # and a block beside them pass the 16 GB
    fsdp2 = [r for r in ranked if r.layout.dp_sync == "fsdp2"]
    assert fsdp2 and all(r.prediction.memory["gathered"] > 0 for r in fsdp2)
    assert all(r.overrides["train.activation_checkpointing"] == "block" for r in fsdp2)
    n = best.layout.rank_parameters(0)
    device, host = DP_STRATEGIES[best.layout.dp_sync].placed_bytes(n, 1, "optimizer")
    assert (device, host) == (8 * n, 16 * n)  # parameters and gradients stay; AdamW's state and its inputs move
    memory = best.prediction.memory
    assert best.prediction.memory_bytes == int(device) + memory["activations"] < 16e9  # the device's, host apart
    assert memory["host"] == int(host) and best.prediction.memory_bytes + host > 16e9  # together they would not fit


def test_where_a_plain_layout_fits_nothing_offloaded_is_listed(tmp_path: Path) -> None:
    ranked, _ = searched(*files(tmp_path, gpu_gb=32))
    assert ranked and all(offload_of(r) == "none" and r.prediction.memory["host"] == 0 for r in ranked)


def test_a_node_whose_host_memory_is_too_small_rejects_the_offload_with_its_bytes(tmp_path: Path) -> None:
    ranked, reasons = searched(*files(tmp_path, gpu_gb=16, host_gb=20))
    n = layout(*WORDS).rank_parameters(0)
    assert not ranked
    assert any(f"needs {16 * n / 1e9:.1f} GB of host memory per node (1 rank(s) x {16 * n / 1e9:.1f} GB, "
               "parallel.offload), over the 20 GB a node holds" in reason for reason in reasons)
    # dp=2: 8N a rank on the host; two ranks on a node need 16N of its 20 GB, one alone 8N
    offloaded = {"parallel.dp": 2, "parallel.dp_sync": "zero2", "parallel.offload": "optimizer",
                 "train.activation_checkpointing": "block"}
    for per_node, fits in ((2, False), (1, True)):
        profile, calib = files(tmp_path, gpu_gb=16, per_node=per_node, host_gb=20)
        cfg = resolve_config(None, [*WORDS, f"launch.profile={profile}"], user=False)[0]
        result = evaluate(cfg, offloaded, target_of(cfg, calib))
        assert isinstance(result, Ranked) == fits
        if not fits:
            assert result.startswith(f"needs {16 * n / 1e9:.1f} GB of host memory per node (2 rank(s) x "
                                     f"{8 * n / 1e9:.1f} GB")


def test_the_sweep_runs_the_offloaded_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, calib = files(tmp_path, gpu_gb=16)
    sweep = tmp_path / "top.yaml"
    assert main(["plan", "search", "--gpus", "1", "--profile", profile, *WORDS, "--calibration", calib,
                 "--top", "3", "--sweep", str(sweep)]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()[:4]
    assert header.split()[6:8] == ["host", "MB"]
    n = layout(*WORDS).rank_parameters(0)
    assert all(row.split()[4] == f"{16 * n / MB:,.0f}" for row in rows)  # the host column: 16N, either offload
    shown = [re.search(r" dp=1 \((\w+)\) offload=(\w+)", row).groups() for row in rows]  # type: ignore[union-attr]
    _, _, points = build_points(sweep, runs_dir=str(tmp_path / "runs"))  # as `gptpar sweep` resolves each point
    assert [(p.cfg.parallel.dp_sync, p.cfg.parallel.offload) for p in points] == shown
    assert len(points) == 3 and all(p.cfg.parallel.dp == 1 for p in points)


def test_a_host_memory_that_is_no_number_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, calib = files(tmp_path, gpu_gb=16, host_gb="lots")  # was float()'s ValueError, a traceback
    assert main(["plan", "search", "--gpus", "1", "--profile", profile, *WORDS, "--calibration", calib]) == 2
    err = capsys.readouterr().err
    assert err == "gptpar: error: profile v100: links.host_memory_GB is 'lots', not a number of GB (e.g. 32)\n"
