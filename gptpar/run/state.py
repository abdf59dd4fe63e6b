"""A run's state, decided in one place from its records, its lock and the scheduler's answer.

The scheduler's answer is passed in (this module never asks SLURM itself), so `gptpar status`
(which asks), `gptpar report` (which does not) and the trainer's resume all use the same rules:
- pending: the scheduler says the job waits (also right after a requeue);
- queued / starting: a launcher on this machine holds the run in its queue (gptpar.run.queue) and its ranks have not
  started yet (a local sweep's later points); starting: its ranks (or its job, says the scheduler) are starting and
  have not logged yet;
- running: the run's lock is held (or its heartbeat is fresh), or the scheduler says it runs; its detail says
  `stuck` while its ranks have waited in one collective longer than parallel.stuck_after_s (gptpar.run.hang.stuck);
- otherwise the logs decide: completed (every rank's last segment says so), diverged (completed
  with a non-finite loss), failed (a rank says failed, or died without a final record, or never
  wrote one), timeout / oom (from the scheduler or the job's stderr), requeued (the log says so and
  no scheduler says the job waits), stopped (every rank stopped at a step boundary on SIGTERM or
  Ctrl-C, or on a requeue request where no scheduler restarts the run; running it again resumes),
  cancelled (`gptpar cancel` ended its job since its last start, and no rank stopped cleanly or failed on its own),
  corrupt (an unreadable log: damaged, or written by a newer gptpar).
- whom a failure is blamed on: a hang's diagnosis first (a rank that failed inside a collective names the rank
  that held it up and its line, from every rank's dump: gptpar.run.hang), where each rank it names dumped; then a
  rank's own error; then a rank that died or
  hung without a final record, when its peers only report losing contact (a collective timed out, a connection
  closed); only then the first of those lost-contact errors.
"""

from __future__ import annotations

import math
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder
from gptpar.run.hang import read_lives, stuck, stuck_after
from gptpar.run.logfile import CorruptLog, RankLog, read_rank_log
from gptpar.run.resume import current_ranks, layout_changes, mixed_configs

STATES = ("queued", "pending", "starting", "running", "completed", "diverged", "requeued", "stopped", "cancelled",
          "failed", "timeout", "oom", "corrupt")
SCHEDULER_STATES = ("pending", "running", "completed", "failed", "timeout", "oom")
LIVE_JOB_STATES = ("queued", "pending", "starting", "running")  # a run in these must not have its folder touched
FINISHED = ("completed", "diverged")  # states in which a start trains nothing
REQUEUE_GRACE_S = 60.0  # a "requeued" final record precedes the scheduler showing the job pending
PLAIN_SCRIPT_RUN = re.compile(r"(dp|pp)-\d+")  # the folder jobs/dp.sbatch and jobs/pp.sbatch name after their job
# A final error saying that a rank lost contact with its peers: the consequence of another rank's death or hang.
PEER_LOST = re.compile(r"gloo|nccl|connection (?:reset|closed|refused)|broken pipe|timed out waiting|"
                       r"Dist(?:Backend|Network|Store)Error", re.IGNORECASE)


NEVER_STARTS = "will never start"  # how a pending job's detail begins when waiting cannot clear its reason


class Pending(str):
    """A scheduler's "pending" (it compares equal to the word) that also says why the job waits, as the user reads it
    (SLURM's reason: "queued: Resources", or NEVER_STARTS with the fix)."""

    why: str

    def __new__(cls, why: str) -> Pending:
        word = super().__new__(cls, "pending")
        word.why = why
        return word


@dataclass
class RunLog:
    """A run folder read whole: config, each rank's stitched log, and its state."""

    folder: RunFolder
    sweep: str  # the folders between the runs folder and the run; "" for a top-level run
    config: dict[str, Any]
    ranks: list[RankLog]
    state: str
    detail: str = ""  # why the run is not completed, in one line
    warnings: list[str] = field(default_factory=list)
    mixed: str = ""  # why its starts ran different configs (gptpar.run.resume.mixed_configs); "" when they ran one

    @property
    def run_id(self) -> str:
        return self.folder.name

    @property
    def reshaped(self) -> str:
        """How its starts continued on other layouts (gptpar.run.resume.layout_changes); "" when it kept one."""
        return layout_changes(self.ranks)


def _last_line(paths: list[Path]) -> str:
    for path in reversed(paths):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return f"{path.name}: {lines[-1][:300]}"
    return ""


def _job_text(folder: RunFolder) -> str:
    return "\n".join(p.read_text(errors="replace") for p in folder.job_errors())


def _rank_reason(folder: RunFolder, rank: int) -> str:
    """The last line of a rank's own stderr (the local launcher's job/rank<R>.err, where the launcher also
    notes a rank it saw killed or stopped); the job's stderr where ranks share it (SLURM)."""
    own = folder.job_dir / f"rank{rank}.err"
    return _last_line([own]) if own.is_file() else _last_line(folder.job_errors())


def resume_hint(folder: RunFolder, launcher: str | None) -> str:
    """The command that resumes a run from its checkpoint, as a user types it: a run `gptpar submit` or `sweep` made
    is submitted again from its own config.yaml (its job record names the kind); a run of jobs/dp.sbatch or
    jobs/pp.sbatch (folder dp-<job id>, pp-<job id>) is that script again with the folder as its argument (which
    `gptpar status` shows as that run while the job waits); a run gptpar
    started here (one process, or the local launcher's ranks) is `gptpar train` of its config.yaml; any other is that
    command again under the launcher that started it."""
    config = shlex.quote(str(folder.config_path))
    kind = folder.read_job_record().get("kind")
    plain = PLAIN_SCRIPT_RUN.fullmatch(folder.name)
    if kind:
        command = f"gptpar submit {kind} {config}"
    elif launcher == "slurm" and plain:
        command = f"sbatch jobs/{plain[1]}.sbatch {shlex.quote(str(folder.path))}"
    elif launcher in ("single", "local"):
        command = f"gptpar train {config}"
    else:
        return (f"running `gptpar train {config}` again under {launcher or 'the launcher that started it'} (the same "
                "ranks) resumes it from its checkpoint")
    return f"`{command}` resumes it from its checkpoint"


def _outside_scheduler(started: list[RankLog]) -> bool:
    """No scheduler will restart these ranks: each header names a launcher other than SLURM and no SLURM job."""
    return bool(started) and all(log.header.get("launcher") not in (None, "slurm")
                                 and not (log.header.get("slurm") or {}).get("job_id") for log in started)


def _signal_of(finals: list[dict[str, Any]]) -> str:
    return next((f" by {f['signal']}" for f in finals if f.get("signal")), "")


def _diverged(log: RankLog) -> bool:
    if not log.steps:
        return False
    last = log.steps[max(log.steps)]
    loss = last.get("global_loss", last["loss"])
    return isinstance(loss, float) and not math.isfinite(loss)


def decide_state(folder: RunFolder, ranks: list[RankLog], scheduler: str | None, now: float,
                 held: bool = False) -> tuple[str, str]:
    """(state, detail) of a run that is not corrupt; `scheduler` is one of SCHEDULER_STATES or None; `held`: the
    caller holds the run's lock (a start claiming it), so the records decide."""
    if scheduler == "pending":
        return "pending", getattr(scheduler, "why", "") or "queued"
    holder = None if held else folder.holder()
    if holder is None and scheduler == "running" and not any(log.headers for log in ranks):
        return "starting", "its job runs; no log record yet"
    if holder is not None or scheduler == "running":
        where = f"host {holder.get('host')} pid {holder.get('pid')}" if holder else "the scheduler says so"
        return "running", f"running ({where})"
    launcher = folder.launcher()
    if launcher is not None:
        where = f"host {launcher.get('host')} pid {launcher.get('pid')}"
        if not launcher.get("job_id"):
            return "queued", f"waiting for its turn in the launcher ({where})"
        since = float(launcher.get("since", 0.0))
        if not any(float(log.headers[-1].get("start_time", 0.0)) >= since for log in ranks if log.headers):
            return "starting", f"job {launcher['job_id']}: its ranks are starting ({where}); no log record yet"
    started = [log for log in ranks if log.headers]
    expected = max((int(log.header["world_size"]) for log in started), default=0)
    finals = {log.rank: log.final for log in started}
    failed = sorted((float(f["time"]), r, f) for r, f in finals.items() if f is not None and f["status"] == "failed")
    own = [(r, f) for _, r, f in failed if not PEER_LOST.search(str(f.get("error", "")))]
    silent = sorted((log for log in started if log.final is None), key=lambda log: (log.last_time, log.rank))
    missing = sorted(set(range(expected)) - {log.rank for log in started})
    # A rank failed inside a collective and named who held it up and where (gptpar.run.hang); a rank that left no
    # dump (killed, say) is better told by the lines below, which read why it ended.
    hung = [f["hang"] for _, _, f in failed if f.get("hang") and all(s["where"] for s in f["hang"]["stuck"])]
    if hung:
        return "failed", f"hung: {hung[0]['summary']}"
    if own:
        rank, final = own[0]
        return "failed", f"rank {rank} failed at step {final['step']}: {final.get('error', 'no error recorded')}"
    if failed and (silent or missing):
        who = missing[0] if missing else silent[0].rank
        step = 0 if missing else max(silent[0].steps, default=0)
        lost = sorted(r for _, r, _ in failed)
        peers = f"rank {lost[0]}" if len(lost) == 1 else "ranks " + ", ".join(map(str, lost))
        reason = _rank_reason(folder, who)
        return "failed", (f"rank {who} stopped responding after step {step}: no final record, and {peers} "
                          "lost contact with it" + (f"; {reason}" if reason else ""))
    if failed:
        _, rank, final = failed[0]
        return "failed", f"rank {rank} failed at step {final['step']}: {final.get('error', 'no error recorded')}"
    outside = _outside_scheduler(started)
    halted = [f for f in finals.values() if f is not None and f["status"] in ("stopped", "requeued")]
    requeued = [f for f in halted if f["status"] == "requeued"]
    if requeued and not outside and scheduler is None and now - float(requeued[0]["time"]) < REQUEUE_GRACE_S:
        return "pending", "requeued; waiting for the scheduler to restart it"
    if started and len(started) >= expected and all(f is not None and f["status"] == "completed"
                                                    for f in finals.values()):
        if any(_diverged(log) for log in started):
            return "diverged", "completed with a non-finite loss"
        return "completed", ""
    text = _job_text(folder)
    resume = resume_hint(folder, started[0].header.get("launcher") if started else None)
    checkpointed = f"; stopped at step {halted[0]['step']} with a checkpoint: {resume}" if halted else ""
    if scheduler in ("timeout", "oom"):
        return scheduler, f"the scheduler reports {scheduler}" + checkpointed
    if "DUE TO TIME LIMIT" in text:
        return "timeout", "the job hit its time limit" + checkpointed
    if "out of memory" in text.lower() or "oom-kill" in text.lower() or "MemoryError" in text:
        return "oom", "out of memory"
    if requeued and not outside:
        return "requeued", f"requeued at step {requeued[0]['step']}; no scheduler reports it waiting"
    if halted and not silent and len(started) >= expected:
        why = " (a requeue request, but no scheduler restarts a run outside SLURM)" if requeued else ""
        return "stopped", f"stopped at step {halted[0]['step']}{_signal_of(halted)}{why}; {resume}"
    cancelled = folder.cancelled_at()
    if cancelled is not None and cancelled >= max((float(log.header["start_time"]) for log in started), default=0.0):
        where = f"at step {max((max(log.steps, default=0) for log in started), default=0)}" if started else \
            "before its first log record"
        return "cancelled", f"cancelled by gptpar cancel {where}; {resume}"
    reason = _last_line(folder.job_errors())
    if not started:
        return "failed", "died before its first log record" + (f" ({reason})" if reason else "")
    silent = silent or started
    age = now - max(log.last_time for log in silent)
    who = f"rank {silent[0].rank}" if not missing else f"rank {missing[0]}"
    reason = _rank_reason(folder, silent[0].rank if not missing else missing[0]) or reason
    return "failed", (f"{who} died without a final record (last record {age / 60:.0f} min ago)"
                      + (f"; {reason}" if reason else ""))


def stuck_detail(folder: RunFolder, started: list[RankLog], now: float) -> str | None:
    """`stuck: ...` while a running run's ranks have waited in one collective for longer than its
    parallel.stuck_after_s, by their live states of this start (each written after its rank's header:
    gptpar.run.hang.stuck); None otherwise."""
    if not started or int(started[0].header["world_size"]) < 2:
        return None
    since = {log.rank: float(log.header.get("start_time", 0.0)) for log in started}
    world, config = int(started[0].header["world_size"]), started[0].header.get("config", {})
    found = stuck(read_lives(folder, since), world, now, stuck_after(config.get("parallel", {})))
    return f"stuck: {found['summary']}" if found else None


def read_run(folder: RunFolder, runs_dir: str | Path | None = None, scheduler: str | None = None,
             now: float | None = None, held: bool = False) -> RunLog:
    """Read one run; a corrupt log makes the run "corrupt" instead of failing the caller. `held`: see decide_state."""
    now = time.time() if now is None else now
    sweep = ""
    if runs_dir is not None:
        rel = folder.path.relative_to(Path(runs_dir))
        sweep = rel.parent.as_posix() if rel.parent != Path(".") else ""
    warnings: list[str] = []
    try:
        config = folder.read_config() or {}
    except Exception as exc:  # a hand-edited config.yaml must not hide the run's logs
        config, warnings = {}, [f"{folder.config_path}: unreadable ({type(exc).__name__})"]
    try:
        ranks = [read_rank_log(p, warnings) for p in folder.rank_logs()]
    except CorruptLog as exc:
        return RunLog(folder, sweep, config, [], "corrupt", str(exc), warnings)
    started = [log for log in ranks if log.headers]
    if started:
        config = started[0].header["config"]  # what ran: the rank side adds the launcher's world size
        world = int(started[0].header["world_size"])
        if len(ranks) < world:
            warnings.append(f"{folder.path}: {len(ranks)} rank file(s) for world_size {world}")
    state, detail = decide_state(folder, current_ranks(ranks), scheduler, now, held)  # not a larger layout's ranks
    if state == "running":
        detail = stuck_detail(folder, started, now) or detail
    return RunLog(folder, sweep, config, started, state, detail, warnings, mixed_configs(started))


def check_checkpoint(run: RunLog, again: str) -> None:
    """Refuse to resume a run whose checkpoint is gone (deleted, or lost with a copy) although its log says one was
    saved: a start would silently train from step 0 again. `again` says how to start over instead."""
    saved = saved_step(run)
    if saved and run.state not in FINISHED and not run.folder.has_checkpoint():
        raise GptparError(f"run folder {run.folder.path} cannot resume: its log says a checkpoint was saved at step "
                          f"{saved}, but {run.folder.checkpoint_path} is missing, so a start would train from step 0 "
                          f"again; put the checkpoint back, or {again}")


def saved_step(run: RunLog) -> int:
    """The latest step at which the log shows a checkpoint saved (0: none): a start that stopped or requeued saved one
    at its last step, and a step logged past a multiple of train.checkpoint_every shows that multiple's save done."""
    every = int((run.config.get("train") or {}).get("checkpoint_every") or 0)
    halted = [log.final["step"] for log in run.ranks if log.final and log.final["status"] in ("stopped", "requeued")]
    return max([*halted, (last_step(run) - 1) // every * every if every else 0, 0])


def replica_indices(ranks: list[RankLog]) -> list[int]:
    """Indices of one started rank per data-parallel replica: its last pipeline stage, which has the loss, and of
    that stage the first rank (tensor-parallel rank 0)."""
    last = max(log.header["coords"].get("pp", 0) for log in ranks)
    chosen: dict[Any, int] = {}
    for i, log in enumerate(ranks):
        coords = log.header["coords"]
        if coords.get("pp", last) == last:
            chosen.setdefault(coords.get("dp", log.rank), i)
    return list(chosen.values())


def last_step(run: RunLog) -> int:
    return max((max(log.steps) for log in run.ranks if log.steps), default=0)


def last_header(folder: RunFolder) -> dict[str, Any]:
    """Rank 0's latest header, or {} (no log yet, or an unreadable one)."""
    if not folder.rank_log(0).is_file():
        return {}
    try:
        headers = read_rank_log(folder.rank_log(0)).headers
    except CorruptLog:
        return {}
    return headers[-1] if headers else {}


def job_of(folder: RunFolder, headers: list[dict[str, Any]] | None = None) -> tuple[str, str] | None:
    """(backend, job id) of a folder's job: from job.json, else (a script sbatch-ed by hand, like jobs/dp.sbatch)
    the SLURM job id in rank 0's last header (`headers`, where the caller has read them); None for a run without
    a job."""
    record = folder.read_job_record()
    if record.get("job_id"):
        return record.get("backend", ""), record["job_id"]
    header = last_header(folder) if headers is None else (headers[-1] if headers else {})
    job = header.get("slurm", {}).get("job_id")
    return ("slurm", str(job)) if job else None
