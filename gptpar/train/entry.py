"""What a rank does from start to exit: join the process group, check its config against the ranks the
launcher started, claim the run folder, train, write the final record, then ask SLURM to requeue the job
or say the run stopped, and leave the group. The config arrives resolved (gptpar.launch.prepare wrote it),
so a rank only checks it (gptpar.parallel.grid.launched_config) and claims its folder (gptpar.run.claim,
which names the run only for ranks started on a config file with no run id).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from gptpar.config import Config
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.flight import dump_on_failure, dumps_on_signal, live_state, mirrored, request_dumps
from gptpar.parallel.grid import grid_sizes, launched_config
from gptpar.parallel.process_group import destroy_distributed, init_distributed
from gptpar.run.claim import claim_run_folder
from gptpar.run.folder import RunFolder, run_folder
from gptpar.run.hang import collect_dumps, diagnose, read_ledgers
from gptpar.run.logfile import RankLogger, segments
from gptpar.run.records import FinalRecord, HeaderRecord
from gptpar.run.sinks import open_sinks
from gptpar.run.start import named_run
from gptpar.run.state import FINISHED, resume_hint
from gptpar.train.checkpoint import load_checkpoint
from gptpar.train.preemption import (
    StopBeforeTraining,
    can_requeue,
    launcher_watch,
    polled,
    requeue_current_job,
    stop_request,
    stop_signals,
)
from gptpar.train.provenance import header_fields, job_id
from gptpar.train.trainer import Trainer

DUMP_WAIT_S = 5.0  # how long a rank that failed inside a collective waits for its peers' dumps (a moment: each is
# written by a thread the dump signal wakes, within milliseconds; a rank that cannot answer is named without a place)


def run_rank(cfg: Config, reshape: bool = False) -> dict[str, Any]:
    """Train as one rank of the job the environment describes (a single process when it describes none); `reshape`:
    the job's ranks continue a stopped run on another layout (`srun gptpar train RUN/config.yaml --reshape ...`)."""
    with stop_signals(), launcher_watch():
        return _run_rank(cfg, reshape)


def _run_rank(cfg: Config, reshape: bool) -> dict[str, Any]:
    named = run_folder(cfg.log.runs_dir, cfg.log.run_id) if cfg.log.run_id else None  # where the launcher named it
    info = init_distributed(cfg.parallel, nccl_trace_prefix=named.nccl_trace_prefix if named else None)
    try:
        launched = launched_config(cfg, info.world_size)  # checked before the folder is touched
        dims = ParallelDims.build(info, grid_sizes(launched))
        with contextlib.ExitStack() as stack:
            folder, state = claim_run_folder(cfg, launched, info, _from_rank_zero, stack, job_id(), reshape)
            if state in FINISHED:
                if info.rank == 0:
                    print(f"gptpar: run {folder.path} is already {state}; nothing to train", flush=True)
                return {"status": state, "run_dir": str(folder.path)}
            if dims.world_size > 1:
                folder.job_dir.mkdir(parents=True, exist_ok=True)
                stack.enter_context(dumps_on_signal(dims.rank, folder.flight_path(dims.rank),
                                                    folder.stack_path(dims.rank)))
                stack.enter_context(mirrored(folder.ledger_path(dims.rank)))
            return _train_in_folder(named_run(launched, folder.name)[0], dims, folder)
    finally:
        destroy_distributed()


def _from_rank_zero(answer: list[Any]) -> None:
    dist.broadcast_object_list(answer, src=0)


def _train_in_folder(cfg: Config, dims: ParallelDims, folder: RunFolder) -> dict[str, Any]:
    log = RankLogger(folder.path, dims.rank)
    if log.torn:
        print(log.torn, file=sys.stderr, flush=True)
    restart = segments(log.path)
    trainer, started, since = None, False, time.time()
    try:
        log.mirror = open_sinks(cfg.log, dims.rank, folder.path)  # closed by log.close()
        trainer = Trainer(cfg, dims, folder, log)
        load_checkpoint(folder.path, {"trainer": trainer}, trainer.checkpoint_name)
        log.write(HeaderRecord(**header_fields(cfg, dims, restart), tokenizer=trainer.tokenizer,
                               vocab_size=trainer.vocab_size, stage_devices=[str(d) for d in trainer.net.stage_devices],
                               total_steps=trainer.total_steps, fast_path=trainer.fast_path(),
                               **({"lora": lora} if (lora := trainer.lora()) is not None else {})))
        started = True
        with polled(), _live(folder, dims):
            status, loss = trainer.run()
            request = stop_request() if status != "completed" else None  # this rank's own signal, if any
            log.write(FinalRecord(status=status, step=trainer.step, loss=trainer.logged_loss(loss),
                                  signal=request[1] if request else None))
    except BaseException as exc:
        if not started:  # set-up or loading the checkpoint failed or was stopped: the segment still says why
            log.write(HeaderRecord(**header_fields(cfg, dims, restart)))
        step = trainer.step if trainer else 0
        if not isinstance(exc, StopBeforeTraining):
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            log.write(FinalRecord(status="failed", step=step, error=error, **_hang(folder, dims, since, exc)))
            raise
        status, loss = "stopped", None  # while the data or the model was prepared: nothing to save yet
        log.write(FinalRecord(status=status, step=step, signal=exc.signal))
    finally:
        log.close()
    step = trainer.step if trainer else 0
    if status == "requeued" and can_requeue():
        if dims.world_size > 1:
            dist.barrier()  # every rank's final record is on disk before SLURM kills the job
        if dims.rank == 0:
            requeue_current_job()
    elif status != "completed":  # stopped, or a requeue asked for where no scheduler restarts the run
        status = "stopped"
        if dims.rank == 0 and dims.launcher != "local":  # the local launcher says it for its ranks
            launcher = dims.launcher if not can_requeue() else "slurm"
            print(f"gptpar: run {folder.path} stopped at step {step}{_by(stop_request())}; "
                  f"{resume_hint(folder, launcher)}", flush=True)
    return {"status": status, "step": step, "loss": loss, "run_dir": str(folder.path)}


def _live(folder: RunFolder, dims: ParallelDims) -> contextlib.AbstractContextManager[None]:
    """This rank's live state while it trains (gptpar.parallel.flight.live_state), from after its header: a live state
    older than this start's header is an earlier start's (gptpar.run.state.stuck_detail)."""
    return live_state(dims.rank, folder.live_path(dims.rank)) if dims.world_size > 1 else contextlib.nullcontext()


def _hang(folder: RunFolder, dims: ParallelDims, since: float, exc: BaseException) -> dict[str, Any]:
    """{"hang": the diagnosis} when this rank failed inside a collective, once it dumped and asked every rank to
    (waiting DUMP_WAIT_S for their dumps); {} otherwise."""
    if dims.world_size == 1 or not dump_on_failure(exc):
        return {}
    asked = request_dumps(os.environ)
    dumps = collect_dumps(folder, dims.world_size, since, DUMP_WAIT_S if asked else 0.0)
    hang = diagnose(dumps, dims.world_size, read_ledgers(folder, dims.world_size, since))
    return {"hang": hang} if hang else {}


def _by(request: tuple[str, str] | None) -> str:
    if request is None:
        return " (asked for on another rank)"
    why = " (a requeue request, but no scheduler restarts a run outside SLURM)" if request[0] == "requeued" else ""
    return f" by {request[1]}{why}"
