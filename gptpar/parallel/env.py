"""Who am I: the rank layout read from the environment that torchrun, srun, submitit or gptpar's local launcher set.

Pure functions of an env mapping, importable without torch, so every launcher's quirks are
unit-tested without a cluster. submitit's TorchDistributedEnvironment is not used: it would treat an
sbatch batch script as rank 0 of N (see the launcher rule below) and by default rewrites
CUDA_VISIBLE_DEVICES, which gptpar never does. A task of a launcher that marks its tasks (its row in
gptpar/launchers.py) is read from SLURM_* under srun, and from the launcher's own variables where it starts its
tasks itself: a submitit job (launch.launcher=submitit) from those submitit's JobEnvironment reads, SLURM_* under
srun and SUBMITIT_LOCAL_* on its local executor, whose tasks get no SLURM_* at all.

Launcher rule: torchrun's RANK/WORLD_SIZE win. SLURM counts only inside a job *step*
(SLURM_STEP_ID set, i.e. under srun) or when the job has a single task: an sbatch batch script
also carries SLURM_PROCID=0 and SLURM_NTASKS>1, and treating it as rank 0 of N would wait
forever for N-1 ranks that nobody started.
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from gptpar.errors import GptparError
from gptpar.launchers import TaskVars, started_by

LAUNCHER_MARKER = "GPTPAR_LAUNCHER"  # set by gptpar's local launchers, so a rank reports which one started it
LAUNCHER_PID = "GPTPAR_LAUNCHER_PID"  # the local launcher's pid, so its ranks can tell when it is gone
# What asks a rank for its stacks and flight recorder (gptpar.parallel.flight), forwarded by the local launcher: USR2
# is the requeue, TERM and INT the stop, USR1 NCCL's.
DUMP_SIGNAL = signal.SIGQUIT
PORT_BASE, PORT_SPAN = 20000, 20000  # SLURM-derived ports stay in 20000..39999 (unprivileged)


@dataclass(frozen=True)
class Layout:
    """Where this process sits, as read from the environment (before backend/device are chosen)."""

    launcher: str  # torchrun | slurm | local (gptpar's launcher) | spawn (spawn_local, tests) | single | the name of
    # a launcher row that marks its tasks (submitit)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: `gpu[001-003,007]`, `a1,b[2-3]`, `n[1-2]-ib[3-4]` (zero padding kept)."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise GptparError(f"bad SLURM node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise GptparError(f"bad SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_host(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [head + value + rest for value in _expand_range(match.group(1), pattern)
            for rest in _expand_host(tail)]


def _expand_range(body: str, pattern: str) -> list[str]:
    values: list[str] = []
    for piece in body.split(","):
        lo, sep, hi = piece.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise GptparError(f"bad SLURM node list range {piece!r} in {pattern!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise GptparError(f"bad SLURM node list range {piece!r} in {pattern!r}: end before start")
        width = len(lo)  # SLURM pads to the width of the range's start, e.g. 001-010
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def slurm_port(job_id: str | int) -> int:
    """A port that is the same on every task of a job and differs between jobs sharing a node (SLURM's, or
    submitit's local executor's)."""
    digits = re.sub(r"\D", "", str(job_id))  # array jobs may look like 1234_5
    return PORT_BASE + int(digits or 0) % PORT_SPAN


def _tasks_per_node(env: Mapping[str, str], world_size: int) -> int:
    """SLURM_NTASKS_PER_NODE if given, else this node's entry of SLURM_TASKS_PER_NODE (`4(x2),3`)."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts: list[int] = []
    for entry in filter(None, env.get("SLURM_TASKS_PER_NODE", "").split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", entry)
        if not match:
            raise GptparError(f"cannot read SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else world_size


def is_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside `srun` (or a one-task job), where SLURM_PROCID really is this process's rank."""
    if "SLURM_PROCID" not in env:
        return False
    return "SLURM_STEP_ID" in env or int(env.get("SLURM_NTASKS", "1")) == 1


def _local_task(launcher: str, names: TaskVars, env: Mapping[str, str]) -> Layout:
    """A task a launcher started itself on this machine (submitit's local executor): one node, the rendezvous port
    derived from its job id (for submitit, the pid of the executor's controller), as a SLURM job's is."""
    world = int(env[names.num_tasks])
    nodes = max(1, int(env.get(names.num_nodes, "1")))
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    port = int(env.get("MASTER_PORT") or slurm_port(env[names.job_id]))
    return Layout(launcher, int(env[names.global_rank]), world, int(env.get(names.local_rank, "0")),
                  world // nodes, addr, port)


def layout_from_env(env: Mapping[str, str]) -> Layout:
    """Read the rank layout; an explicit MASTER_ADDR/MASTER_PORT always wins."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        launcher = env.get(LAUNCHER_MARKER) or "torchrun"
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", 0))
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500))
        return Layout(launcher, rank, world, local_rank, local_world, addr, port)
    marked = started_by(env)  # a task of a launcher that marks its tasks (submitit)
    if marked is not None and marked.local_tasks is not None and marked.local_tasks.global_rank in env:
        return _local_task(marked.name, marked.local_tasks, env)
    if is_slurm_step(env):
        world = int(env.get("SLURM_NTASKS", "1"))
        rank, local_rank = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        local_world = _tasks_per_node(env, world)
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
        addr = env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
        port = int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0")))
        return Layout(marked.name if marked else "slurm", rank, world, local_rank, local_world, addr, port)
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500))
    return Layout("single", 0, 1, 0, 1, addr, port)


def own_job(env: Mapping[str, str]) -> tuple[str, str] | None:
    """How every task of this rank's job is signalled (gptpar.launchers.signal_job's `via` and `target`): through the
    local launcher that started it, or as a task of a SLURM step (sbatch's srun, submitit's); None where nothing
    reaches them all (torchrun, whose agent a SIGQUIT would end; submitit's local executor; a single process)."""
    if env.get(LAUNCHER_PID):
        return "pid", env[LAUNCHER_PID]
    if is_slurm_step(env) and "RANK" not in env and env.get("SLURM_JOB_ID"):
        return "slurm", env["SLURM_JOB_ID"]
    return None


def free_port() -> int:
    """A TCP port free on this host now, for a local launcher's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


