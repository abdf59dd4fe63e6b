"""The trainer's components that decide their own cadence, so the step loop only says "a step happened" and
"an epoch ended": checkpoints, evaluation, and the metrics (step records, the memory record, progress, the epoch's
record). The profiler (profiling.py) follows the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLogger
from gptpar.run.records import EpochRecord, EvalRecord, MemoryRecord, StepRecord
from gptpar.train.checkpoint import save_checkpoint
from gptpar.train.progress import Progress


class Checkpointing:
    """A checkpoint every train.checkpoint_every steps (0: none between), and one when a start ends, completed,
    stopped or requeued, so that the next start continues exactly there. `owner` has state_dict/load_state_dict."""

    def __init__(self, folder: RunFolder, every: int, owner: Any):
        self.path, self.every, self.owner = folder.path, every, owner

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_step(self, step: int) -> None:
        if self.due(step):
            self.save()

    def save(self) -> None:
        save_checkpoint(self.path, {"trainer": self.owner})


class Evaluation:
    """Validation every train.eval_every steps (an eval record; 0: only at epoch ends), and at each epoch end the
    validation loss and the task's scores (BLEU) that the epoch record carries."""

    def __init__(self, every: int, evaluate: Callable[[], float | None],
                 scores: Callable[[], dict[str, float | None]], log: RankLogger, progress: Progress):
        self.every, self.evaluate, self.scores, self.log, self.progress = every, evaluate, scores, log, progress

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_step(self, step: int, epoch: int) -> None:
        if not self.due(step):
            return
        val = self.evaluate()
        self.log.write(EvalRecord(step=step, epoch=epoch, val_loss=val))
        if val is not None:
            self.progress.message(f"step {step}: val_loss {val:.4f}")

    def at_epoch_end(self) -> dict[str, Any]:
        return {"val_loss": self.evaluate(), **self.scores()}


class Metrics:
    """What a rank reports of its steps: each step's record, the memory record of a start's first step, the
    progress line (job tokens/s over the `replicas`), and an epoch's time and mean rate for its record."""

    def __init__(self, log: RankLogger, progress: Progress, replicas: int):
        self.log, self.progress, self.replicas = log, progress, replicas
        self.memory_logged = False
        self.epoch_start, self.epoch_time, self.epoch_rates = 0, 0.0, []

    def begin_epoch(self, step: int) -> None:
        self.epoch_start, self.epoch_time, self.epoch_rates = step, 0.0, []

    def after_step(self, record: StepRecord, memory: dict[str, int]) -> None:
        self.log.write(record)
        self.epoch_time += record.step_time_s
        self.epoch_rates.append(record.tokens_per_s)
        self.progress.update(record.step, record.global_loss, record.tokens * self.replicas / record.step_time_s)
        if not self.memory_logged:
            self.log.write(MemoryRecord(step=record.step, **memory))
            self.memory_logged = True

    def epoch_steps(self, step: int) -> int:
        """Steps this start ran in the current epoch."""
        return step - self.epoch_start

    def end_epoch(self, epoch: int, step: int, fields: dict[str, Any]) -> None:
        self.log.write(EpochRecord(epoch=epoch, training_time_s=self.epoch_time,
                                   tokens_per_s=sum(self.epoch_rates) / len(self.epoch_rates),
                                   steps=self.epoch_steps(step), **fields))
        val = fields["val_loss"]
        self.progress.message(f"epoch {epoch}: {self.epoch_time:.2f} s" +
                              (f", val_loss {val:.4f}" if val is not None else "") +
                              "".join(f", {key} {score:.2f}" for key, score in fields.items()
                                      if key != "val_loss" and score is not None))
