"""The local backend: a job's ranks as processes on this machine, each running exactly the command a
SLURM task runs (`gptpar train config.yaml` in the run folder), with torchrun-style variables.

This is also how `gptpar train parallel.dp=N` starts its ranks outside SLURM and torchrun. The
launcher waits for its ranks and forwards INT/TERM/USR2 to them (and the dump signal, and SIGCONT to a stopped
rank), so a Ctrl-C, a TERM or a preemption signal reaches every rank (each stops at a step boundary
with a checkpoint; a third INT/TERM kills them). When one rank fails it gives the others a moment to
write their final records, then stops them; a rank whose process was stopped (SIGSTOP) cannot write
anything and is killed at once. A launcher killed outright (SIGKILL) forwards nothing: its ranks notice
that it is gone and stop the same way (gptpar.train.preemption.launcher_watch). Each rank's stderr (and
the stdout of ranks > 0) goes to job/rank<R>.*; a rank that the launcher saw killed by a signal or
stopped gets one last line there saying so (gptpar.run.state reads it).
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from gptpar.launch.prepare import Point, rank_command
from gptpar.launch.profiles import JobSpec
from gptpar.launch.slurm import clean_env
from gptpar.launchers import signal_job
from gptpar.parallel.env import DUMP_SIGNAL, LAUNCHER_MARKER, LAUNCHER_PID, free_port
from gptpar.run.folder import handed_fds
from gptpar.run.queue import starting

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, DUMP_SIGNAL, signal.SIGCONT)
PEER_GRACE_S = 10.0  # after a rank fails, its peers' own timeouts and errors get this long to be logged
KILL_AFTER = 3  # the third INT/TERM kills the ranks (the first stops them at a step boundary)


def omp_threads(env: Mapping[str, str], ranks_here: int) -> str:
    """OMP_NUM_THREADS for a rank: the user's, else SLURM's CPUs per task, else this machine's cores split between
    the ranks it runs, so that ranks sharing a node do not oversubscribe it."""
    cores = max(1, (os.cpu_count() or 1) // ranks_here)
    return env.get("OMP_NUM_THREADS") or env.get("SLURM_CPUS_PER_TASK") or str(cores)


def rank_env(rank: int, world: int, port: int, base: dict[str, str]) -> dict[str, str]:
    """torchrun's variables for one local rank, none of a surrounding job's, and this launcher's pid (its ranks
    watch it); OMP_NUM_THREADS as omp_threads says (the local launcher's ranks run outside any SLURM job)."""
    threads = omp_threads(clean_env(base), world)
    return {**clean_env(base), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LAUNCHER_MARKER: "local", LAUNCHER_PID: str(os.getpid()), "OMP_NUM_THREADS": threads}


def run_ranks(point: Point, world: int) -> int:
    """Run `world` ranks of `point` here and wait; 0 when every rank exited cleanly. Rank 0, which claims the run
    folder, gets the run lock's descriptor that this launcher holds (gptpar.run.folder.RunLock.hand_down)."""
    job_dir = point.folder.job_dir
    job_dir.mkdir(parents=True, exist_ok=True)
    port, command = free_port(), rank_command(point.cfg)
    procs: list[subprocess.Popen] = []
    for rank in range(world):
        out = None if rank == 0 else open(job_dir / f"rank{rank}.out", "ab")
        with open(job_dir / f"rank{rank}.err", "ab") as err:
            procs.append(subprocess.Popen(command, cwd=point.folder.path, stdout=out, stderr=err,
                                          env=rank_env(rank, world, port, dict(os.environ)),
                                          start_new_session=True, pass_fds=handed_fds() if rank == 0 else ()))
        if out is not None:
            out.close()
    forward = _Forwarder(procs)
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        return _wait(procs, forward.killed)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _note_ends(procs, forward.killed, job_dir)


class _Forwarder:
    """The launcher's handler of INT/TERM/USR2, DUMP_SIGNAL and SIGCONT: passes each on to every live rank; the
    KILL_AFTER-th INT/TERM kills them instead; SIGCONT goes to a stopped rank (SIGSTOP) alone, so that a rank that
    asks for every rank's dump (DUMP_SIGNAL, then SIGCONT: gptpar.parallel.flight.request_dumps) gets the stopped
    one's own stack before anything kills it, and a running rank never mistakes the SIGCONT for having been stopped.
    `killed` collects why the launcher killed a rank."""

    def __init__(self, procs: Sequence[subprocess.Popen]):
        self.procs, self.stops, self.killed = procs, 0, {}

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.stops += signum in (signal.SIGINT, signal.SIGTERM)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                if self.stops >= KILL_AFTER:
                    self.killed[rank] = f"was killed by the launcher after {self.stops} INT/TERM signals"
                    proc.kill()
                elif signum != signal.SIGCONT or _stopped_by(proc.pid):
                    proc.send_signal(signum)


def _stopped_by(pid: int) -> str | None:
    """The signal that stopped a child process (SIGSTOP, SIGTSTP, ...); None while it runs or once it ended."""
    try:  # WNOWAIT: the stop stays reported; Popen.poll never looks at stops
        info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
    except (AttributeError, OSError):  # no waitid here, or the child was reaped
        return None
    if info is None or info.si_code != os.CLD_STOPPED:
        return None
    return _signal_name(info.si_status)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _wait(procs: Sequence[subprocess.Popen], killed: dict[int, str]) -> int:
    """Wait for every rank. Once one fails, a stopped rank is killed at once (it cannot write its final
    record, and its peers' collectives time out waiting for it), the others after PEER_GRACE_S."""
    failed: tuple[float, int] | None = None
    while any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if failed is None and any(c not in (None, 0) for c in codes):
            failed = (time.monotonic(), next(r for r, c in enumerate(codes) if c not in (None, 0)))
        if failed is not None:
            waited = time.monotonic() - failed[0]
            for rank, proc in enumerate(procs):
                if codes[rank] is not None or rank in killed:
                    continue
                if sig := _stopped_by(proc.pid):
                    killed[rank] = f"was stopped by {sig}; killed by the launcher after rank {failed[1]} failed"
                elif waited > PEER_GRACE_S:
                    killed[rank] = (f"was still running {PEER_GRACE_S:g} s after rank {failed[1]} failed; "
                                    "killed by the launcher")
                else:
                    continue
                proc.kill()
        time.sleep(0.1)
    return next((p.returncode for p in procs if p.returncode != 0), 0)


def _note_ends(procs: Sequence[subprocess.Popen], killed: dict[int, str], job_dir: Path) -> None:
    """One last line in job/rank<R>.err for each rank killed by a signal: who killed or stopped it."""
    for rank, proc in enumerate(procs):
        code = proc.poll()
        if code is None or code >= 0:
            continue
        why = killed.get(rank) or f"was killed by {_signal_name(-code)}"
        with open(job_dir / f"rank{rank}.err", "a") as err:
            err.write(f"gptpar: rank {rank} (pid {proc.pid}) {why}\n")


# Jobs this process has run, over all its LocalBackends (each api.submit makes one): the next one's number.
_STARTED = itertools.count(1)


def local_job_id(host: str, pid: int, n: int) -> str:
    """The id of the n-th job a local launcher (process `pid` on `host`) runs: `host:pid.n`, one per point, as a
    SLURM array gives each task its own id, so `gptpar status` and the console tell a sweep's points apart."""
    return f"{host}:{pid}.{n}"


class LocalBackend:
    """Runs each point now, as local processes, and returns when it has finished; each point is a job of its own,
    announced by a line naming the point and its job id before its ranks start."""

    name = "local"
    where = "local processes on this machine"
    scheduler = ""  # the ranks are the job: cancel interrupts them (gptpar.launch.backend.cancel_run)

    def submit(self, points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> list[str]:
        ids, world = [], spec.nodes * spec.tasks_per_node
        for point in points:
            job_id = local_job_id(socket.gethostname(), os.getpid(), next(_STARTED))
            point.folder.write_job_record(self.name, job_id, spec.kind)
            print(f"{point.label or point.folder.name}: job {job_id} starts, {world} rank(s) on this machine",
                  flush=True)
            with starting(point.folder, job_id):
                run_ranks(point, world)
            ids.append(job_id)
        return ids

    def check(self, spec: JobSpec) -> None:
        """Nothing to refuse: this machine runs whatever shape prepare_run accepted."""

    def state(self, job_id: str) -> str | None:
        """None: a local run's own lock says whether it runs (gptpar.run.state)."""
        return None

    def cancel(self, job_id: str) -> None:
        """Interrupt the launcher of a local run (it forwards the signal to its ranks)."""
        self.signal(job_id, (signal.SIGINT,))

    def signal(self, job_id: str, signals: Sequence[signal.Signals]) -> bool:
        """To the launcher of a local run on this host, which passes each signal on to its ranks."""
        host, _, job = job_id.partition(":")
        pid = job.partition(".")[0]
        return host == socket.gethostname() and pid.isdigit() and signal_job("pid", pid, signals)
