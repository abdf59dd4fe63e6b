"""Synthetic calibrations and networks for the planner's tests: costs chosen so that the predictions can be computed
by hand (a block's F, B and W take given seconds, the head and optimizer none, links given latency and bandwidth)."""

from __future__ import annotations

from pathlib import Path

from gptpar.plan.calibration import COLLECTIVES, Calibration, LinkFit, installed_torch, local_device_name
from gptpar.plan.layout import Layout, block_flops, layout_of
from gptpar.plan.network import Network
from gptpar.user_defaults import resolve_config

FREE = [[1e30, 1e-30]]  # a rate so high that any work takes no time


def layout(*words: str) -> Layout:
    base = ["data.source=synthetic", "data.vocab_size=4096", "train.precision=fp32"]
    return layout_of(resolve_config(None, [*base, *words], user=False)[0])


def calibration(lay: Layout, f: float = 1.0, b: float = 1.0, w: float = 1.0, activation: float = 100.0,
                device_name: str = "test cpu", torch_version: str = "2.13.0+cpu", device: str = "cpu") -> Calibration:
    """One block's F, B and W on `lay`'s micro-batch take f, b and w seconds; the head and optimizer are free. On a
    `device` other than cpu, collectives overlap computation (the cost model's GPU path)."""
    flops = block_flops(lay.shape, lay.tokens, lay.seq_len, lay.tp)
    compute = {kind: [[x, s]] for kind, x, s in zip(("block_f", "block_b", "block_w"), flops, (f, b, w), strict=True)}
    compute |= {"head_f": FREE, "head_bw": FREE, "optimizer": FREE}
    return Calibration(device=device, device_name=device_name, backend="gloo", precision="fp32",
                       torch_version=torch_version, threads=1, date="2026-11-27", host="test", world_size=2,
                       compute=compute, activation_bytes_per_token_width=activation)


def network(latency: float = 0.0, bandwidth: float = 1e30) -> Network:
    return Network(measured={op: LinkFit(latency, bandwidth) for op in COLLECTIVES})


def machine_calibration(path: Path) -> Path:
    """A calibration of this machine (its CPU's name, the installed torch) with collectives measured, written to
    `path`: what the commands accept for the local profile."""
    c = calibration(layout("model.preset=gpt2-tiny"), device_name=local_device_name(), torch_version=installed_torch())
    c.collectives.update({op: [[4096.0, 1e-4], [2.0**20, 1e-3]] for op in COLLECTIVES})
    path.write_text(c.to_json())
    return path
