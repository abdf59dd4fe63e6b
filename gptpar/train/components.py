"""The trainer's components that decide their own cadence, so the step loop only says "a step happened" and
"an epoch ended": checkpoints, evaluation, and the metrics (step records, the memory record, progress, the epoch's
record). The profiler (profiling.py) follows the same shape. Inside the optimizer step the optional parts
(experts, a sharded mixture's gradients, the memory count, the gradient dump) are `Participant`s the step calls at
their moments, so the step itself never asks which of them a run has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gptpar.parallel.context_parallel import ContextParallel
from gptpar.parallel.data_parallel.base import GradSync
from gptpar.parallel.expert_parallel import ExpertParallel
from gptpar.parallel.tensor_parallel.mixture import ShardedMixtureGradients
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLogger
from gptpar.run.records import EpochRecord, EvalRecord, MemoryRecord, StepRecord
from gptpar.train.checkpoint import save_checkpoint
from gptpar.train.grad_dump import dump_gradients
from gptpar.train.memory import state_bytes
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
        self.owner.sync.save_engine(self.path, self.owner.step)  # an engine's own checkpoint first (deepspeed's)
        save_checkpoint(self.path, {"trainer": self.owner})


def scored(fields: dict[str, Any]) -> str:
    """An evaluation's fields after the validation loss, as the progress line shows them: `, accuracy 0.83`."""
    return "".join(f", {key} {score:.2f}" for key, score in fields.items() if key != "val_loss" and score is not None)


class Evaluation:
    """Validation every train.eval_every steps (an eval record; 0: only at epoch ends), and at each epoch end the
    validation loss and the task's scores (BLEU) that the epoch record carries. `val_scores` are the scores of the
    validation pass itself (classify's accuracy), read after each `evaluate`, in both records."""

    def __init__(self, every: int, evaluate: Callable[[], float | None],
                 val_scores: Callable[[], dict[str, float | None]],
                 scores: Callable[[int], dict[str, float | None]], log: RankLogger, progress: Progress):
        self.every, self.evaluate, self.val_scores, self.scores = every, evaluate, val_scores, scores
        self.log, self.progress = log, progress

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_step(self, step: int, epoch: int) -> None:
        if not self.due(step):
            return
        val = self.evaluate()
        extra = self.val_scores()
        self.log.write(EvalRecord(step=step, epoch=epoch, val_loss=val, **extra))
        if val is not None:
            self.progress.message(f"step {step}: val_loss {val:.4f}{scored(extra)}")

    def at_epoch_end(self, epoch: int) -> dict[str, Any]:
        val = self.evaluate()
        return {"val_loss": val, **self.val_scores(), **self.scores(epoch)}


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
                              (f", val_loss {val:.4f}" if val is not None else "") + scored(fields))


class Participant:
    """An optional part of the optimizer step, called at its moments in the order the trainer lists them (torchtitan's
    components own their cadence): `after_backward` once the gradients are synced over the replicas (before the norm
    and the optimizer), `after_optimizer(step)` after the optimizer ran (or an fp16 overflow skipped it) and before
    the gradients are reset; `step` is the 1-based number of the step taken. Each hook does nothing by default."""

    def after_backward(self) -> None:
        pass

    def after_optimizer(self, step: int) -> None:
        pass


class ExpertGradients(Participant):
    """Expert parallelism's (or a capacity's) experts: their gradients summed over the replicas that hold them, and
    reset with the rest (gptpar.parallel.expert_parallel)."""

    def __init__(self, experts: ExpertParallel):
        self.experts = experts

    def after_backward(self) -> None:
        self.experts.finish()

    def after_optimizer(self, step: int) -> None:
        self.experts.zero_grad()


class MixtureGradients(Participant):
    """A mixture under sequence parallelism: its parameters' gradients summed over the tp group after the sync."""

    def __init__(self, gradients: ShardedMixtureGradients):
        self.gradients = gradients

    def after_backward(self) -> None:
        self.gradients.finish()


class MemoryCount(Participant):
    """The training state's bytes (the memory record), counted once, at this start's first step: AdamW's state
    exists only after its first update, and the gradients are still there. The sync's clip targets are the tensors it
    holds gradients in (under parallel.offload the device's shards beside the host's copies)."""

    def __init__(self, net: nn.Module, optimizer: torch.optim.Optimizer, sync: GradSync,
                 context: ContextParallel | None = None):
        self.net, self.optimizer, self.sync, self.context = net, optimizer, sync, context
        self.counted: dict[str, int] | None = None

    def after_optimizer(self, step: int) -> None:
        if self.counted is None:
            held, _ = self.sync.clip_targets()
            saved = self.context.saved_bytes if self.context is not None else None  # its first forward's count
            self.counted = (state_bytes(self.net, self.optimizer, held, self.sync.host_tensors()) |
                            self.sync.memory_fields() | ({"attention_bytes": saved} if saved is not None else {}))


class GradientDump(Participant):
    """train.dump_grads: the run's last step's synced gradients, the assignment's files (gptpar.train.grad_dump)."""

    def __init__(self, net: nn.Module, folder: str, last_step: int, rank: int):
        self.net, self.folder, self.last_step, self.rank = net, folder, last_step, rank

    def after_optimizer(self, step: int) -> None:
        if step == self.last_step:
            dump_gradients(self.net.original_parameters(), self.folder, self.rank)
