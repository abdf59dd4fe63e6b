"""What a collective costs over one group of ranks: the calibration's measured links where the layout runs on the
machine that was calibrated, else the cluster profile's figures (`links:` in gptpar/cluster/profiles/*.yaml, each with
its source), intra-node for a group inside one node and inter-node for one that spans nodes. The grid's rank order
(gptpar.parallel.grid: pp, dp, cp, tp, tp fastest) says which groups span nodes. parallel.offload's copies between a GPU
and its host go over `links.host_device`, else PCIe 4.0 x16 (HOST_DEVICE)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gptpar.errors import GptparError
from gptpar.plan.calibration import Calibration, LinkFit

# The host-device link where the profile names none: PCIe 4.0 x16 moves 32 GB/s each way on paper (PCI-SIG's PCIe 4.0
# base specification: 16 GT/s a lane, 128b/130b encoding); copies from pinned memory reach about 25 GB/s of it.
HOST_DEVICE = LinkFit(0.0, 25e9, "PCIe 4.0 x16: 32 GB/s each way on paper (PCI-SIG), ~25 GB/s for pinned copies; "
                      "the planner's default, latency unknown: 0")


def profile_link(links: dict[str, Any], where: str, profile: str) -> LinkFit | None:
    """A profile's `intra_node`, `inter_node` or `host_device` figures as a LinkFit (latency counted 0 where the
    profile has none)."""
    figures = links.get(where)
    if not figures:
        return None
    if not figures.get("bandwidth_GBps"):
        raise GptparError(f"profile {profile}: links.{where} needs bandwidth_GBps (GB/s each way)")
    latency = figures.get("latency_us") or 0.0
    return LinkFit(float(latency) * 1e-6, float(figures["bandwidth_GBps"]) * 1e9,
                   str(figures.get("source", "")) + ("" if figures.get("latency_us") else "; latency unknown: 0"))


@dataclass(frozen=True)
class Network:
    """The links of one job: measured ones (by op), the profile's intra- and inter-node ones, GPUs per node."""

    measured: dict[str, LinkFit] = field(default_factory=dict)
    intra: LinkFit | None = None
    inter: LinkFit | None = None
    gpus_per_node: int = 0  # 0: every rank on one machine
    profile: str = "local"
    host_device: LinkFit = HOST_DEVICE  # one device's link to its host (parallel.offload's copies)

    def seconds(self, op: str, nbytes: float, size: int, stride: int = 1) -> float:
        """One `op` of `nbytes` over a group of `size` ranks whose members are `stride` ranks apart."""
        if nbytes <= 0 or (size < 2 and op != "send_recv"):
            return 0.0
        spans = bool(self.gpus_per_node) and stride * (size - 1 if op != "send_recv" else 1) >= self.gpus_per_node
        if spans:
            if self.inter is None:
                raise GptparError(f"profile {self.profile} has no links.inter_node figures, and this layout's "
                                  f"{op} spans nodes; add them (bandwidth_GBps, latency_us, source) or use fewer GPUs")
            return self.inter.seconds(op, nbytes, size)
        link = self.measured.get(op) or self.intra
        if link is None:
            raise GptparError(f"no link figures for a {op} inside a node: the calibration measured no collectives "
                              f"(one device) and profile {self.profile} has no links.intra_node; add them, or "
                              "calibrate on 2 or more devices")
        return link.seconds(op, nbytes, size)


def network_of(calib: Calibration, profile: dict[str, Any], name: str, on_calibrated_machine: bool) -> Network:
    """The job's links: the calibration's measured collectives inside one machine or node (a calibration is only
    used on its own kind of device), the profile's figures between nodes and where nothing was measured."""
    links = profile.get("links") or {}
    measured = {op: fit for op in calib.collectives if (fit := calib.link(op)) is not None}
    return Network(measured=measured, intra=profile_link(links, "intra_node", name),
                   inter=profile_link(links, "inter_node", name),
                   host_device=profile_link(links, "host_device", name) or HOST_DEVICE,
                   gpus_per_node=0 if on_calibrated_machine else int(links.get("gpus_per_node") or 0), profile=name)
