"""The local backend: a job's ranks as processes on this machine, each running exactly the command a
SLURM task runs (`gptpar train config.yaml` in the run folder), with torchrun-style variables.

This is also how `gptpar train parallel.dp=N` starts its ranks outside SLURM and torchrun. The
launcher waits for its ranks, forwards INT/TERM/USR2 to them (so a Ctrl-C or a preemption signal
reaches every rank), and when one rank fails gives the others a moment to write their final
records, then stops them. Each rank's stderr (and the stdout of ranks > 0) goes to job/rank<R>.*.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from gptpar.launch.plan import Point, rank_command
from gptpar.launch.profiles import JobSpec
from gptpar.parallel.env import LAUNCHER_MARKER, free_port

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
PEER_GRACE_S = 10.0  # after a rank fails, its peers' own timeouts and errors get this long to be logged


def rank_env(rank: int, world: int, port: int, base: dict[str, str]) -> dict[str, str]:
    """torchrun's variables for one local rank; OMP_NUM_THREADS splits the machine's cores between the
    ranks unless the user set it."""
    threads = base.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    clean = {k: v for k, v in base.items() if k not in TORCHRUN_VARS and not k.startswith("SLURM_")}
    return {**clean, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LAUNCHER_MARKER: "local", "OMP_NUM_THREADS": threads}


def run_ranks(point: Point, world: int) -> int:
    """Run `world` ranks of `point` here and wait; 0 when every rank exited cleanly."""
    job_dir = point.folder.job_dir
    job_dir.mkdir(parents=True, exist_ok=True)
    port, command = free_port(), rank_command(point.cfg)
    procs: list[subprocess.Popen] = []
    for rank in range(world):
        out = None if rank == 0 else open(job_dir / f"rank{rank}.out", "ab")
        with open(job_dir / f"rank{rank}.err", "ab") as err:
            procs.append(subprocess.Popen(command, cwd=point.folder.path, stdout=out, stderr=err,
                                          env=rank_env(rank, world, port, dict(os.environ)),
                                          start_new_session=True))
        if out is not None:
            out.close()
    previous = {sig: signal.signal(sig, _forward(procs)) for sig in FORWARDED}
    try:
        return _wait(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward(procs: Sequence[subprocess.Popen]):
    def handler(signum: int, frame: FrameType | None) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    return handler


def _wait(procs: Sequence[subprocess.Popen]) -> int:
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.1)
    return next((p.returncode for p in procs if p.returncode != 0), 0)


class LocalBackend:
    """Runs each point now, as local processes, and returns when it has finished."""

    name = "local"
    where = "local processes on this machine"

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        ids = []
        for point in points:
            job_id = f"{socket.gethostname()}:{os.getpid()}"
            point.folder.write_job_record(self.name, job_id)
            run_ranks(point, spec.nodes * spec.tasks_per_node)
            ids.append(job_id)
        return ids

    def state(self, job_id: str) -> str | None:
        """None: a local run's own lock says whether it runs (gptpar.run.state)."""
        return None

    def cancel(self, job_id: str) -> None:
        """Interrupt the launcher of a local run (it forwards the signal to its ranks)."""
        host, _, pid = job_id.partition(":")
        if host == socket.gethostname() and pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGINT)
            except ProcessLookupError:
                pass
