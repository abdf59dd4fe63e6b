"""The cluster profiles (gptpar/cluster/profiles/*.yaml, or a profile file a user names): what a cluster's nodes,
partitions and links are, read alike by the launcher (its job scripts) and the planner (its links and GPU memory)."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

from gptpar.config import read_yaml
from gptpar.errors import GptparError

PROFILE_DIR = Path(__file__).with_name("profiles")
GPU_REQUESTS = ("gpus", "gpus_per_node", "gres")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name: str) -> dict[str, Any]:
    """A shipped profile by name, or any profile file by path (a name ending in .yaml). A name with a
    control character (a newline above all) is refused: the profile is named in the job script."""
    if CONTROL.search(name):
        raise GptparError(f"launch.profile: {name!r} holds a control character; rename the profile file")
    path = Path(name) if name.endswith((".yaml", ".yml")) else PROFILE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise GptparError(f"launch.profile: no profile {name!r}; shipped: {', '.join(profile_names())} "
                          "(or a path to a .yaml file)")
    return copy.deepcopy(_read_profile(path, path.stat().st_mtime_ns))


@functools.lru_cache(maxsize=32)
def _read_profile(path: Path, mtime_ns: int) -> dict[str, Any]:
    """A profile file, parsed once while it is unchanged (`mtime_ns`): a sweep resolves a job for every point."""
    data = read_yaml(path) or {}
    if data.get("gpu_request", "gres") not in GPU_REQUESTS:
        raise GptparError(f"{str(path)!r}: gpu_request must be one of {', '.join(GPU_REQUESTS)}")
    return data
