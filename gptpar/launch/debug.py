"""`gptpar debug RUN`: ask a live run's ranks for their dumps and say what they show, without stopping it.

Every rank of the run's job gets the dump signal through its backend (the same gptpar.launchers.signal_job a rank
uses when it fails in a collective), and answers with its flight recorder and stacks in the run folder
(gptpar.parallel.flight); what came within DEBUG_WAIT_S is read as a hang's diagnosis is (gptpar.run.hang). A rank
stopped (SIGSTOP) is not continued, as a timeout's request does: asking must not change the run, so it is named as
not answering.
"""

from __future__ import annotations

import time
from typing import Any

from gptpar.errors import GptparError
from gptpar.launch.backend import job_state, signal_run
from gptpar.parallel.env import DUMP_SIGNAL
from gptpar.run.folder import RunFolder
from gptpar.run.hang import collect_dumps, collective_text, diagnose, innermost
from gptpar.run.state import job_of, read_run

DEBUG_WAIT_S = 5.0  # how long the ranks' dumps are waited for: each is written within milliseconds of the signal


def debug_run(folder: RunFolder, job: tuple[str, str] | None = None, wait_s: float = DEBUG_WAIT_S) -> str:
    """Ask every rank of the running run in `folder` (its job: `job`, else the folder's own) for a dump; the
    diagnosis and each rank's place, as lines."""
    job = job or job_of(folder)
    run = read_run(folder, scheduler=job_state(job))
    if run.state != "running" or not run.ranks:
        raise GptparError(f"run {folder.path} is {run.state}, not running: no rank to ask (its last dumps, if any, "
                          f"are in {folder.job_dir}/rank<R>.stack)")
    world = int(run.ranks[0].header["world_size"])
    if world < 2:
        raise GptparError(f"run {folder.path} has one rank: it keeps no flight recorder to dump (parallel.dp, tp, pp "
                          "or cp above 1 start several)")
    since = time.time()
    if not signal_run(folder, (DUMP_SIGNAL,), job):
        where = f"{job[0]} job {job[1]}" if job else f"held by {(folder.holder() or {}).get('host')}"
        raise GptparError(f"cannot reach the ranks of run {folder.path} from here ({where}); on their host, "
                          f"`kill -{DUMP_SIGNAL.name.removeprefix('SIG')} PID` asks one rank (PIDs: "
                          f"{folder.job_dir}/rank<R>.live.json)")
    dumps = collect_dumps(folder, world, since, wait_s)
    hang = diagnose(dumps, world)
    lines = [f"{folder.path}: asked its {world} ranks for their dumps ({DUMP_SIGNAL.name}); "
             f"{len(dumps)} answered within {wait_s:g} s",
             f"hang: {hang['summary']}" if hang else "no rank waits inside a collective"]
    lines += [_rank_line(rank, dumps.get(rank)) for rank in range(world)]
    lines.append(f"every thread's stack: {folder.job_dir}/rank<R>.stack")
    return "\n".join(lines)


def _rank_line(rank: int, dump: dict[str, Any] | None) -> str:
    """Where a rank is, from its dump: gptpar's innermost frame and the collective it waits in."""
    if dump is None:
        return (f"rank {rank}: no answer (stopped, or its Python cannot run: faulthandler's stacks are in its "
                "job/rank<R>.err)")
    where, function = innermost(dump.get("frames", []))
    blocked = dump.get("blocked")
    doing = f", waiting in {collective_text(blocked)}" if blocked else f", at step {dump.get('step')}"
    return f"rank {rank} ({dump['host']}, pid {dump['pid']}): {where} ({function}){doing}"
