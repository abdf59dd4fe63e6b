"""Cluster profiles (gptpar.cluster.profiles) resolved with `launch.*` overrides into a JobSpec.

Limits are checked here, before anything is submitted, so a request a site would reject (or
queue forever) fails at once with the limit named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpar.cluster.profiles import load_profile
from gptpar.cluster.shape import job_shape
from gptpar.config import PRECISIONS, Config
from gptpar.errors import GptparError
from gptpar.hardware import peaks_of
from gptpar.launchers import LAUNCHERS

# Values written into #SBATCH lines: a comment line cannot be shell-quoted, so only plain tokens pass.
SAFE_TOKEN = re.compile(r"[A-Za-z0-9_.:,+@-]*")
MODULE_GUARD = "if command -v module >/dev/null; then  # environment modules exist on this node"
TIME = re.compile(r"(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})")


@dataclass(frozen=True)
class JobSpec:
    """Everything the sbatch header needs, already validated against the profile."""

    kind: str
    profile: str
    partition: str
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    cpus_per_task: int
    time: str
    account: str
    qos: str
    constraint: str
    gpu_directive: str
    signal_s: int
    setup: tuple[str, ...]


def guarded_setup(lines: Sequence[str]) -> list[str]:
    """A profile's set-up lines as a job script runs them: `module` lines only where environment modules exist, so
    a node without them (the local cluster, a container) starts the job without `module: command not found`."""
    out: list[str] = []
    for line in lines:
        if not line.startswith("module "):
            out.append(line)
            continue
        if out[-1:] == ["fi"] and out[-2].startswith("  module "):
            out.pop()  # one guard around consecutive module lines
        else:
            out.append(MODULE_GUARD)
        out += [f"  {line}", "fi"]
    return out


# launch keys whose empty value takes the profile's.
PROFILE_KEYS = ("partition", "account", "qos", "constraint", "gpu_type")


def profile_values(cfg: Config) -> dict[str, tuple[str, str]]:
    """The launch keys left empty that the profile fills, each with its value and `profile <name>`, for `config
    show`: the same values `resolve` puts in a job."""
    prof = load_profile(cfg.launch.profile)
    name = f"profile {Path(cfg.launch.profile).stem}"
    return {f"launch.{key}": (str(prof[key]), name) for key in PROFILE_KEYS
            if not getattr(cfg.launch, key) and prof.get(key)}


def time_seconds(text: str, key: str = "launch.time") -> int:
    match = TIME.fullmatch(text)
    if not match:
        raise GptparError(f"{key}: {text!r} is not a walltime of the form HH:MM:SS or D-HH:MM:SS")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _token(key: str, value: str) -> str:
    if not SAFE_TOKEN.fullmatch(value):
        raise GptparError(f"{key}: {value!r} may hold only letters, digits and _ . : , + @ -")
    return value


def _gpu_directive(request: str, gpu_type: str, gpus_per_node: int, nodes: int) -> str:
    if gpus_per_node == 0:
        return ""
    typed = f"{gpu_type}:" if gpu_type else ""
    if request == "gpus":
        return f"--gpus={typed}{gpus_per_node * nodes}"
    if request == "gpus_per_node":
        return f"--gpus-per-node={typed}{gpus_per_node}"
    return f"--gres=gpu:{typed}{gpus_per_node}"


def _check_limits(name: str, prof: dict[str, Any], spec: JobSpec) -> None:
    partitions = prof.get("partitions") or {}
    if partitions and spec.partition not in partitions:
        raise GptparError(f"launch.partition: {spec.partition!r} is not a partition of profile {name}; "
                          f"choose one of: {', '.join(repr(p) for p in partitions)}")
    part = partitions.get(spec.partition) or {}
    where = f"profile {name} partition {spec.partition or '(default)'}"
    max_gpus = part.get("max_gpus_per_node")
    if max_gpus is not None and spec.gpus_per_node > max_gpus:
        raise GptparError(f"launch.gpus={spec.gpus_per_node} exceeds the limit of {max_gpus} GPUs per node "
                          f"on {where}")
    if part.get("whole_nodes") and spec.gpus_per_node != part["gpus_per_node"]:
        raise GptparError(f"launch.gpus={spec.gpus_per_node}: {where} allocates whole nodes; "
                          f"use launch.gpus={part['gpus_per_node']} (or a shared partition)")
    max_nodes = part.get("max_nodes")
    if max_nodes is not None and spec.nodes > max_nodes:
        raise GptparError(f"launch.nodes={spec.nodes} exceeds the limit of {max_nodes} node(s) on {where}")
    max_cpg = prof.get("max_cpus_per_gpu") or 0
    cpus = spec.cpus_per_task * spec.tasks_per_node
    if max_cpg and spec.gpus_per_node and cpus > max_cpg * spec.gpus_per_node:
        raise GptparError(f"launch.cpus_per_task={spec.cpus_per_task} asks {cpus} CPUs per node for "
                          f"{spec.gpus_per_node} GPU(s); {where} allows at most {max_cpg} CPUs per GPU")
    if prof.get("max_time") and time_seconds(spec.time) > time_seconds(prof["max_time"], "max_time"):
        raise GptparError(f"launch.time={spec.time} exceeds the walltime limit {prof['max_time']} of {where}")


def check_precision(precision: str, gpu_type: str, gpus: int) -> None:
    """Refuse a precision the job's GPU type lacks (bf16 or tf32 on a V100) now, not after the queue wait; auto picks
    one the GPU has, and an unknown type (or a job without GPUs) is left to the ranks."""
    allowed = [p for p in PRECISIONS if p in (peaks_of(gpu_type) or {})] if gpus and gpu_type else []
    if allowed and precision not in ("auto", *allowed):
        raise GptparError(f"train.precision={precision}: the job's {gpu_type} GPUs (launch.gpu_type) support "
                          f"{', '.join(allowed)} or auto")


def resolve(cfg: Config, kind: str) -> JobSpec:
    """The job of a planned config: its shape from the rank grid (gptpar.cluster.shape.job_shape), the
    rest from the profile, overridden by every set launch.* key. `kind` only names the job."""
    launch = cfg.launch
    prof = load_profile(launch.profile)
    shape = job_shape(cfg)
    gpus = max(shape.gpus_per_node, 1)
    cpus = launch.cpus_per_task or max(1, int(prof.get("cpus_per_gpu", 1)) * gpus // shape.tasks_per_node)
    if time_seconds(launch.time) % 60 and LAUNCHERS[launch.launcher].whole_minutes:
        raise GptparError(f"launch.time={launch.time}: launch.launcher={launch.launcher} takes whole minutes; use a "
                          "time ending in :00")
    spec = JobSpec(
        kind=kind,
        profile=Path(launch.profile).stem,
        partition=_token("launch.partition", launch.partition or str(prof.get("partition") or "")),
        nodes=shape.nodes,
        gpus_per_node=shape.gpus_per_node,
        tasks_per_node=shape.tasks_per_node,
        cpus_per_task=cpus,
        time=launch.time,
        account=_token("launch.account", launch.account or str(prof.get("account") or "")),
        qos=_token("launch.qos", launch.qos or str(prof.get("qos") or "")),
        constraint=_token("launch.constraint", launch.constraint or str(prof.get("constraint") or "")),
        gpu_directive=_gpu_directive(prof.get("gpu_request", "gres"),
                                     _token("launch.gpu_type", launch.gpu_type or str(prof.get("gpu_type") or "")),
                                     shape.gpus_per_node, shape.nodes),
        signal_s=launch.signal_s,
        setup=tuple(str(line) for line in prof.get("setup") or ()),
    )
    _check_limits(Path(launch.profile).stem, prof, spec)
    check_precision(cfg.train.precision, launch.gpu_type or str(prof.get("gpu_type") or ""), shape.gpus_per_node)
    return spec


def account_warning(spec: JobSpec, env: Mapping[str, str]) -> str | None:
    """One line where a cluster profile's job names no account (launch.account, nor sbatch's SBATCH_ACCOUNT): a
    cluster that bills an allocation refuses it at submission, which a dry run never reaches."""
    if spec.profile == "local" or spec.account or env.get("SBATCH_ACCOUNT"):
        return None
    return (f"warning: profile {spec.profile}: no account (launch.account, GPTPAR_ACCOUNT or SBATCH_ACCOUNT); a "
            "cluster that bills an allocation refuses the job; set launch.account=...")
