"""`gptpar doctor`: what this install and this node can do, before a job finds out the hard way.

Each check reports `ok`, a `finding` (something a user should know or fix: no GPU visible, SLURM unreachable, a
GPU whose architecture the torch wheel was not built for, little free space) or `broken` (the install itself
cannot work: a required package does not import). The command exits 0 when every check ran, findings included,
and 1 only when something is broken, so it can gate a job script. torch is imported here, inside the checks,
never by `gptpar/launch/` (the login side stays torch-free).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gptpar import __version__
from gptpar.config import Config
from gptpar.errors import GptparError
from gptpar.paths import check_path

# What training imports; a failure here is a broken install, not a finding.
REQUIRED = ("torch", "transformers", "tokenizers", "yaml", "orjson", "matplotlib")
LOW_SPACE_BYTES = 5 * 2**30
# The optional packages (pyproject's extras): module -> (its extra, the feature it enables). Missing is a finding.
OPTIONAL = {
    "datasets": ("hf", "Hugging Face data sets, data.source=hf:..."),
    "sacrebleu": ("translation", "BLEU of data.task=translation"),
    "tensorboard": ("tensorboard", "log.tensorboard=true"),
    "wandb": ("wandb", "log.wandb=offline|online"),
}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | finding | broken
    detail: str


def arch_finding(capability: tuple[int, int], arch_list: list[str]) -> str | None:
    """Why a GPU of compute `capability` cannot run this wheel's kernels, or None when it can: the wheel must hold
    its sm_XY, or PTX (compute_XY) of an architecture at or below it, which the driver compiles."""
    major, minor = capability
    own = major * 10 + minor
    numbers = {tag: int(tag.split("_")[1]) for tag in arch_list if tag.split("_")[-1].isdigit()}
    if f"sm_{own}" in numbers or any(tag.startswith("compute_") and n <= own for tag, n in numbers.items()):
        return None
    return (f"the GPU is sm_{own} but this torch wheel holds {', '.join(arch_list) or 'no CUDA kernels'}; install "
            "a wheel built for it (make install TORCH_SPEC=... with the CUDA index, see docs/cluster.md)")


def _imports() -> Iterator[Check]:
    for module in REQUIRED:
        try:
            version = getattr(importlib.import_module(module), "__version__", "")
        except Exception as exc:  # any import failure (missing, broken shared library) is the finding itself
            yield Check(module, "broken", f"does not import ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                        "run make install")
        else:
            yield Check(module, "ok", version or "imports")


def _optional() -> Iterator[Check]:
    """Each optional package: installed (found, not imported: wandb alone takes seconds) or missing, with the feature
    it enables and how to install it."""
    for module, (extra, feature) in OPTIONAL.items():
        if importlib.util.find_spec(module) is not None:
            yield Check(module, "ok", f"installed (optional: {feature})")
        else:
            yield Check(module, "finding", f"missing (optional): needed for {feature}; pip install 'gptpar[{extra}]' "
                        "or make install")


def _gpus() -> Iterator[Check]:
    import torch

    built = torch.version.cuda
    if not built:
        gpu_node = shutil.which("nvidia-smi") is not None
        wasted = ", but this node has NVIDIA GPUs (nvidia-smi): install the CUDA build (see docs/cluster.md)"
        yield Check("torch build", "finding" if gpu_node else "ok", "CPU only (gloo; no NCCL)" + (wasted * gpu_node))
        return
    yield Check("torch build", "ok", f"CUDA {built}")
    count = torch.cuda.device_count()
    if count == 0:
        yield Check("GPUs", "finding", "none visible here (a login node, or no --gres/--gpus in this step)")
        return
    arch_list = torch.cuda.get_arch_list()
    for index in range(count):
        name, capability = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
        problem = arch_finding(capability, arch_list)
        yield Check(f"cuda:{index}", "finding" if problem else "ok",
                    problem or f"{name}, sm_{capability[0]}{capability[1]} (in the wheel's {' '.join(arch_list)})")
    nccl = torch.cuda.nccl.version()
    yield Check("NCCL", "ok", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))


def _slurm(cfg: Config, origins: Mapping[str, str]) -> Iterator[Check]:
    from gptpar.cluster.profiles import load_profile
    from gptpar.launch import slurm

    reason = slurm.unreachable_reason()
    yield Check("SLURM", "finding" if reason else "ok", reason or "sinfo answers")
    try:
        load_profile(cfg.launch.profile)
        yield Check("profile", "ok", f"{cfg.launch.profile} (from {origins.get('launch.profile', 'default')})")
    except GptparError as exc:
        yield Check("profile", "finding", str(exc))
    account = cfg.launch.account
    if account or cfg.launch.profile != "local":
        yield Check("account", "ok" if account else "finding",
                    f"{account} (from {origins.get('launch.account')})" if account else
                    "none set (launch.account=..., GPTPAR_ACCOUNT or the user file); clusters that bill an "
                    "allocation refuse the job")


def _nearest_existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path


def _space(cfg: Config) -> Iterator[Check]:
    from gptpar.data.sources import data_dir

    places: dict[str, Callable[[], Path]] = {
        "runs": lambda: check_path(cfg.log.runs_dir, "folder", "log.runs_dir", "name a folder for the runs",
                                   must_exist=False),
        "data cache": lambda: data_dir(cfg.data, create=False),
        "HF cache": lambda: check_path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"), "folder",
                                       "HF_HOME", "name a folder for the Hugging Face cache", must_exist=False)}
    for name, place in places.items():
        try:
            path = place()
        except GptparError as exc:  # a file where the folder would be: every write there would fail
            yield Check(f"space: {name}", "finding", str(exc))
            continue
        free = shutil.disk_usage(_nearest_existing(path)).free
        low = free < LOW_SPACE_BYTES
        yield Check(f"space: {name}", "finding" if low else "ok",
                    f"{free / 2**30:.1f} GiB free at {path}" + (" (low; move it, e.g. to $PROJECT)" if low else ""))


def run_checks(cfg: Config, origins: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in order; one that fails unexpectedly is reported as broken rather than stopping the rest."""
    checks = [Check("gptpar", "ok", f"{__version__} on Python {platform.python_version()}"), *_imports(),
              *_optional()]
    groups: list[tuple[str, Callable[[], Iterator[Check]]]] = [("SLURM", lambda: _slurm(cfg, origins or {})),
                                                               ("space", lambda: _space(cfg))]
    if all(c.status == "ok" for c in checks if c.name == "torch"):
        groups.insert(0, ("GPUs", _gpus))
    for name, group in groups:
        try:
            checks.extend(group())
        except Exception as exc:  # a check that cannot run says so and the others still run
            checks.append(Check(name, "broken", f"{type(exc).__name__}: {exc}".splitlines()[0]))
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{c.status:<8} {c.name:<{width}}  {c.detail}" for c in checks]
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "finding", "broken")}
    lines.append(f"{counts['ok']} ok, {counts['finding']} finding(s), {counts['broken']} broken")
    return "\n".join(lines)
