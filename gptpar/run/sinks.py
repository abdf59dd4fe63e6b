"""Optional mirrors of the per-rank JSONL log in TensorBoard and Weights & Biases.

The JSONL log stays the source of truth: `RankLogger` hands a sink each record only after the record
is on disk, and a sink that fails (a W&B error, a full disk) prints one warning line and is dropped,
so neither the log nor the training ever depends on a mirror. The x axis is the step number.

TensorBoard (`log.tensorboard=true`, the `tensorboard` extra): rank 0 writes the run's scalars
(`train/*` from step records; `eval/*`, every evaluation: the validation loss (and classify's `eval/accuracy`,
`eval/accuracy_top5`), and an epoch's scores such as
`eval/bleu`, `eval/test_bleu` and `eval/answer_accuracy`, at the step the epoch ended on; `epoch/*` an epoch's
timing; `memory/*` once per start) to `runs/<id>/tb/`, and
every rank its own `throughput/tokens_per_s` to `runs/<id>/tb/rank<R>/`, one TensorBoard run per
rank, so the ranks' throughput can be compared in one chart. A restarted run appends new event files
to the same folders; each start's writers mark its first step as a purge step, so TensorBoard drops
what an earlier start logged for the steps this one does again: like the JSONL reader, the latest
start wins. Wall times are the records' own.

W&B (`log.wandb`, the `wandb` extra): rank 0 only, one W&B run per gptpar run: its id is the gptpar
run id (stable across requeues, `resume="allow"`), its config the resolved config of the header.
`offline` is the mode for clusters, whose compute nodes often have no internet: it writes
`runs/<id>/wandb/offline-run-<time>-<id>/` (one folder per start) without touching the network,
and `wandb sync runs/<id>/wandb/offline-run-*` later uploads every start in order into the one W&B
run. `online` needs credentials beforehand (`wandb login` or WANDB_API_KEY; on a terminal without
them W&B asks for them) and internet: without internet `wandb.init` gives up after INIT_TIMEOUT_S,
the sink is dropped with a warning and training goes on; at the end uploads wait at most
FINISH_TIMEOUT_S. W&B keeps the first value of a step a
restart does again (it ignores steps at or below the last one it has).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from gptpar.config import LogConfig
from gptpar.errors import require_extra
from gptpar.run.folder import TB_FOLDER
from gptpar.run.logfile import Mirror
from gptpar.run.records import EpochRecord, StepRecord, names

THROUGHPUT_TAG = "throughput/tokens_per_s"
# The fields each record kind mirrors, as `<prefix>/<field>`; None: every numeric field but the step and epoch, so an
# evaluation metric a later gptpar logs (an epoch's BLEU, test BLEU, answer accuracy, ...) is mirrored without a change
# here.
MIRRORED: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "step": ("train", names(StepRecord, "loss", "global_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                            "peak_mem_bytes", "bubble", "loss_scale")),
    "eval": ("eval", None),
    "epoch": ("eval", None),
    "memory": ("memory", None),
}
# An epoch record's own bookkeeping, which is not an evaluation: mirrored as `epoch/<field>`.
EPOCH_TIMING = names(EpochRecord, "training_time_s", "tokens_per_s", "steps")
TB_FLUSH_S = 10  # how stale a live TensorBoard may be; a killed job loses at most this much of the mirror
INIT_TIMEOUT_S = 60  # W&B online without internet: give up the mirror, not the run
FINISH_TIMEOUT_S = 60  # W&B online: the rest stays on disk for `wandb sync`


class RecordSink(Mirror, Protocol):
    name: str  # in the warning when it fails


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers by tag; null fields (a stage without the loss, no bubble) are left out."""
    if record["kind"] not in MIRRORED:
        return {}
    prefix, fields = MIRRORED[record["kind"]]
    names = fields if fields is not None else [k for k in record if k not in ("kind", "time", "step", "epoch")]
    return {f"{'epoch' if record['kind'] == 'epoch' and name in EPOCH_TIMING else prefix}/{name}": record[name]
            for name in names if isinstance(record.get(name), (int, float)) and not isinstance(record[name], bool)}


class TensorBoardSink:
    """Rank 0's scalars in tb/, every rank's throughput in tb/rank<R>/; writers open at the first step
    record, whose step is the purge step of this start."""

    name = "TensorBoard"

    def __init__(self, run_dir: Path, rank: int):
        self._writer = require_extra("torch.utils.tensorboard", "log.tensorboard=true", "tensorboard").SummaryWriter
        self.folder = Path(run_dir) / TB_FOLDER
        self.rank = rank
        self.main: Any = None  # rank 0's writer of the run's scalars
        self.own: Any = None  # this rank's writer of its throughput

    def _open(self, purge_step: int) -> None:
        self.own = self._writer(str(self.folder / f"rank{self.rank}"), purge_step=purge_step, flush_secs=TB_FLUSH_S)
        if self.rank == 0:
            self.main = self._writer(str(self.folder), purge_step=purge_step, flush_secs=TB_FLUSH_S)

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "step" and self.own is None:
            self._open(record["step"])
        if self.own is None:
            return
        if self.main is not None:
            for tag, value in scalars(record).items():
                self.main.add_scalar(tag, value, record["step"], walltime=record["time"])
        if record["kind"] == "step":
            self.own.add_scalar(THROUGHPUT_TAG, record["tokens_per_s"], record["step"], walltime=record["time"])

    def close(self) -> None:
        for writer in (self.main, self.own):
            if writer is not None:
                writer.close()
        self.main = self.own = None


class WandbSink:
    """One W&B run per gptpar run, started at the header (which carries the run id and the config)."""

    name = "W&B"

    def __init__(self, run_dir: Path, project: str, mode: str):
        self.wandb = require_extra("wandb", f"log.wandb={mode}", "wandb")
        self.run_dir, self.project, self.mode = Path(run_dir), project, mode
        self.run: Any = None
        self.exit_code = 0  # 1 once the final record says failed: W&B then marks the run failed

    def _start(self, header: dict[str, Any]) -> Any:
        # wandb-core otherwise looks up W&B's error-report server, even offline; a user's own setting wins.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        settings = self.wandb.Settings(silent=True, console="off", init_timeout=INIT_TIMEOUT_S,
                                       finish_timeout=FINISH_TIMEOUT_S)
        return self.wandb.init(project=self.project, id=header["run_id"], name=header["run_id"], resume="allow",
                               dir=str(self.run_dir), mode=self.mode, config=header["config"], settings=settings)

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "header":
            self.run = self._start(record)
        elif self.run is not None and (values := scalars(record)):
            self.run.log(values, step=record["step"])
        if record["kind"] == "final":
            self.exit_code = int(record["status"] == "failed")

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=self.exit_code)
            # finish() may return before wandb-core has written the run's last records; teardown waits for it,
            # so a job killed right after (a requeue) loses nothing.
            self.wandb.teardown()


class Sinks:
    """Forwards each record to every sink; a sink that raises is dropped and reported in one line, once,
    so a mirror never costs the log or the run."""

    def __init__(self, sinks: list[RecordSink], rank: int):
        self.sinks, self.rank = sinks, rank
        self.step = 0  # the last step record's: the x of a record without a step of its own (an epoch's)

    def _warn(self, sink: RecordSink, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"gptpar: warning: rank {self.rank}: the {sink.name} mirror is off from here on ({reason}); "
              "the JSONL log is complete", file=sys.stderr, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        if "step" in record:
            self.step = record["step"]
        elif record["kind"] in MIRRORED:
            record = {**record, "step": self.step}
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as exc:
                self.sinks.remove(sink)
                self._warn(sink, exc)
                with contextlib.suppress(Exception):  # release what it holds; its error is reported already
                    sink.close()

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                self._warn(sink, exc)


def open_sinks(log: LogConfig, rank: int, run_dir: Path) -> Sinks:
    """The mirrors the config asks for. Every rank checks the W&B package, though only rank 0 uses it,
    so a missing one stops every rank at the same point, before any collective."""
    sinks: list[RecordSink] = []
    if log.tensorboard:
        sinks.append(TensorBoardSink(run_dir, rank))
    if log.wandb != "off":
        wandb = WandbSink(run_dir, log.wandb_project, log.wandb)
        if rank == 0:
            sinks.append(wandb)
    return Sinks(sinks, rank)
