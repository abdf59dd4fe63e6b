"""Where a layout would run, as the planner needs it: the device (this machine for the local profile, else the
profile's GPU), the calibration that fits it, the network between its ranks, and what a GPU holds."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpar.cluster.profiles import load_profile
from gptpar.config import Config
from gptpar.errors import GptparError
from gptpar.plan.calibration import CALIBRATION_FLAG, Calibration, find, local_device_name
from gptpar.plan.network import Network, network_of


def gpus_hidden(env: Mapping[str, str]) -> bool:
    """CUDA_VISIBLE_DEVICES empty or -1 hides every GPU: the ranks then train on the CPU, as torch sees none."""
    return env.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")


def local_gpu_name() -> str | None:
    """This machine's first visible GPU by nvidia-smi (no torch import), or None without one."""
    if gpus_hidden(os.environ) or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else None


@dataclass(frozen=True)
class Target:
    device: str
    local: bool  # this machine (the local profile), not a cluster's nodes
    profile_name: str
    profile: dict[str, Any]
    calibration: Calibration
    calibration_name: str
    network: Network

    @property
    def memory_bytes(self) -> float | None:
        """What one device holds for training, from the profile's `links.gpu_memory_GB`; None where unknown."""
        return self._link_bytes("gpu_memory_GB")

    @property
    def host_memory_bytes(self) -> float | None:
        """What one node's host memory holds (parallel.offload's parts), from the profile's `links.host_memory_GB`;
        None where unknown: then unlimited."""
        return self._link_bytes("host_memory_GB")

    def _link_bytes(self, key: str) -> float | None:
        """The profile's `links.<key>` (GB) in bytes; None where absent or 0; a value that is no positive number is one
        line naming it."""
        gb = (self.profile.get("links") or {}).get(key)
        if not gb:
            return None
        try:
            value = float(gb)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(gb, bool) or not math.isfinite(value) or value < 0:
            raise GptparError(f"profile {self.profile_name}: links.{key} is {gb!r}, not a number of GB (e.g. 32)")
        return value * 1e9

    @property
    def gpus_per_node(self) -> int:
        """The profile's `links.gpus_per_node`; 0 where unknown (every rank on one machine)."""
        return int((self.profile.get("links") or {}).get("gpus_per_node") or 0)


def target_of(cfg: Config, calibration: str | None, key: str = CALIBRATION_FLAG) -> Target:
    """The device, calibration (named by `key`) and network of `cfg`'s launch.profile (the local profile: this
    machine)."""
    name = Path(cfg.launch.profile).stem
    profile = load_profile(cfg.launch.profile)
    local = name == "local"
    if local:
        device = local_gpu_name() or local_device_name()
    else:
        described, asked = str(profile.get("device") or profile.get("gpu_type") or ""), cfg.launch.gpu_type
        if profile.get("links") and described and asked and asked.lower() != described.lower():
            raise GptparError(f"launch.gpu_type={asked}: profile {name}'s links and GPU memory describe {described} "
                              f"nodes; plan with launch.gpu_type={described}, or give the {asked} nodes a profile "
                              "of their own (links: as in gptpar/cluster/profiles/bridges2.yaml)")
        device = str(profile.get("device") or asked or profile.get("gpu_type") or "")
        if not device:
            raise GptparError(f"profile {name} names no GPU (device: or gpu_type:); set launch.gpu_type, e.g. a100")
    calib, label = find(calibration, device, local, key)
    return Target(device, local, name, profile, calib, label, network_of(calib, profile, name, local))
