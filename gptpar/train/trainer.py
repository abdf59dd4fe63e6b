"""One rank's training run: whatever the parallelism, the same loop runs on every rank.

Data parallelism enters through the data shard (the grid's dp coordinate) and the gradient sync
(the grid's dp group), one-process model/pipeline parallelism through the module that maps token ids
to logits, and the multi-process pipeline (parallel.pp > 1) through its engine, which runs a step's
forwards and backwards on this rank's stages; the loop itself does not change. A rank's life around the
loop (process group, run folder, final record) is gptpar.train.entry's.
data.task=translation runs under every layout: its masked loss is token-weighted over the whole step (micro-batches,
pipeline chunks, replicas), and its BLEU is decoded wherever the layout lets a forward run (gptpar.train.scoring).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.data import Dataset

from gptpar.clock import DeviceClock
from gptpar.config import Config, TrainConfig, example_width
from gptpar.data import partition_dataset
from gptpar.data.pairs import target_tokens
from gptpar.data.training import Collate, load_training_data
from gptpar.errors import GptparError
from gptpar.models import architecture
from gptpar.models.build import add_lora, build_model, count_params
from gptpar.models.lora import lora_targets, trainable_count
from gptpar.models.loss import no_target_loss
from gptpar.parallel.comm import WAITING, comm_span, gather_to_first, new_step, read_sent, read_spent
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.flight import RECORDER
from gptpar.parallel.grid import GRID_DIMS
from gptpar.parallel.pipeline.engine.executor import Weight, by_rows
from gptpar.parallel.pipeline.names import model_name
from gptpar.parallel.tensor_parallel.mixture import ShardedMixtureGradients
from gptpar.parallel.tensor_parallel.state import counts_in_norm
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLogger
from gptpar.strategies.data_parallel import DP_STRATEGIES
from gptpar.train.bleu import require_sacrebleu
from gptpar.train.checkpoint import load_model_state, model_state
from gptpar.train.classify import Accuracy, ValidationScores
from gptpar.train.components import (
    Checkpointing,
    Evaluation,
    ExpertGradients,
    GradientDump,
    MemoryCount,
    Metrics,
    MixtureGradients,
    Participant,
)
from gptpar.train.moe import RouterLoad
from gptpar.train.optim import clip_gradients, kind_of, learning_rate, make_optimizer
from gptpar.train.parallelize import parallelize
from gptpar.train.precision import Precision
from gptpar.train.preemption import stop_request
from gptpar.train.profiling import StepProfiler
from gptpar.train.progress import Progress, peak_memory_bytes
from gptpar.train.recompute import compile_mode, loss_kernel
from gptpar.train.scoring import Scoring
from gptpar.train.step_records import PendingStep, PendingSteps, Spans, sync_every

Batch = tuple[torch.Tensor, ...]  # inputs, labels, and the position ids of packed rows (data.packing)


def epoch_steps(loader: Iterable[Batch], accum: int, skip_steps: int, steps_per_epoch: int) -> Iterator[list[Batch]]:
    """An epoch's optimizer steps from this rank's loader, each `accum` micro-batches, the first `skip_steps` skipped:
    step k of any dp size and any accum is rows [k * batch, (k + 1) * batch) of the epoch's global order
    (gptpar.data.partition), so a run resumed on another layout (--reshape) continues at the next sample."""
    micro = iter(islice(loader, skip_steps * accum, steps_per_epoch * accum))
    return iter(lambda: list(islice(micro, accum)), [])


def shard_loader(train_set: Dataset, collate: Collate, replica: int, replicas: int, train: TrainConfig, epoch: int
                 ) -> Iterable[Batch]:
    """A data-parallel replica's micro-batches of an epoch (gptpar.data.partition), of any task's training set."""
    return partition_dataset(replica, replicas, train_set, train.batch_size // train.grad_accum, collate,
                             seed=train.seed, epoch=epoch)


def replica_steps(train_set: Dataset, collate: Collate, replica: int, replicas: int, train: TrainConfig, epoch: int,
                  skip_steps: int, steps_per_epoch: int) -> Iterator[list[Batch]]:
    """A replica's optimizer steps of an epoch from step `skip_steps` on (epoch_steps over its shard_loader), the
    epoch's crops and flips drawn first where the set augments: what the trainer trains on, and a start resumed on
    any layout continues with."""
    if hasattr(train_set, "set_epoch"):  # a named image set's data.augment draws new crops each epoch
        train_set.set_epoch(epoch)
    return epoch_steps(shard_loader(train_set, collate, replica, replicas, train, epoch), train.grad_accum,
                       skip_steps, steps_per_epoch)


def micro_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor,
               labels: torch.Tensor, divisor: float) -> torch.Tensor:
    """A micro-batch's mean loss over its divisor (Trainer._loss_divisors); a cp rank's shard of pair rows may hold no
    target (divisor inf): no_target_loss."""
    return loss_fn(logits, labels) / divisor if divisor < math.inf else no_target_loss(logits)


class Trainer:
    """Set-up (data, model, sync, optimizer), the step loop, evaluation, checkpoints and step logs."""

    def __init__(self, cfg: Config, dims: ParallelDims, folder: RunFolder, log: RankLogger):
        self.cfg, self.dims, self.folder, self.log = cfg, dims, folder, log
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.precision = Precision.from_config(t, dims.device)  # first: a device that cannot run it fails at once
        if cfg.data.task == "translation" and t.bleu_samples:
            require_sacrebleu()  # now, not after the first epoch
        data = load_training_data(cfg)
        self.train_set, self.val_set, self.collate = data.train, data.val, data.collate
        self.vocab_size, self.tokenizer, self.pairs = data.vocab_size, data.tokenizer, data.pairs
        self.classes = data.classes
        self.micro_batch = t.batch_size // t.grad_accum  # global, over all replicas
        self.capped = data.pairs.capped if data.pairs else ""  # what data.max_chars dropped
        if len(self.train_set) < self.micro_batch:
            why = (f": {self.capped}; raise data.max_chars (0 reads all) or lower train.batch_size" if self.capped
                   else " of the corpus; lower it or use a larger corpus")
            raise GptparError(f"train.batch_size={t.batch_size} exceeds the {len(self.train_set)} training "
                              f"examples{why}")
        model = build_model(cfg.model, self.vocab_size, t.seed, cfg.data.hub_timeout_s, seq_len=example_width(cfg),
                            init_device=cfg.model.init_device, shards=dims.size("tp"))
        if t.lora_rank:  # before any wrapper: every parallelism sees the adapted model, its frozen weights frozen
            model = add_lora(model, t, t.seed)
        self.n_params, self.model_config = count_params(model), model.config  # whole, before any sharding
        self.n_trainable = trainable_count(model)
        self.arch = architecture(model)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))  # the LM head is the token table
        shape, routers = cfg.model.shape(), self.arch.routers(model)
        sequence_shards = dims.group("tp") if cfg.parallel.sequence_parallel else None
        self.router_load = RouterLoad(routers, shape.n_experts, shape.top_k, dims.replica_group(), dims.replicas(),
                                      dims.group("pp"), dims.device, sequence_shards) if routers else None
        # The ranks over which losses and token counts are summed: dp, or dp x cp (each cp rank a share of the rows).
        self.dp_group, self.tp_group = dims.replica_group(), dims.group("tp")
        wrapped = parallelize(model, cfg, dims, self.vocab_size, self.router_load)
        self.net, self.sync, self.pipeline = wrapped.net, wrapped.sync, wrapped.pipeline
        self.loss_fn, self.loss_context, self.whole_logits = wrapped.loss_fn, wrapped.loss_context, wrapped.whole_logits
        self.checkpoint_layout, self.experts = wrapped.checkpoint_layout, wrapped.experts
        self.context = wrapped.context
        if self.router_load is not None:  # each cp rank routes its share of the rows
            self.router_load.context = self.context
        if self.router_load is not None and self.experts is not None and cfg.model.moe_capacity_factor:
            self.router_load.dropped_source = self.experts.dropped
        # What holds its parameters as pieces of the checkpoint's whole tensors, each saving and loading its own.
        self.state_layouts = [layout for layout in (self.checkpoint_layout, self.experts) if layout is not None]
        own = self.sync.own_optimizer()
        self.optimizer = own if own is not None else make_optimizer(self.sync.optimizer_params(), t)
        if dims.rank == 0:
            for name, text in self.sync.run_files().items():
                (folder.path / name).write_text(text)
        self.steps_per_epoch = len(shard_loader(self.train_set, self.collate, self.dims.coord("dp"),
                                                self.dims.size("dp"), t, 0)) // t.grad_accum
        self.total_steps = t.epochs * self.steps_per_epoch
        if t.max_steps:
            self.total_steps = min(self.total_steps, t.max_steps)
        self.step = 0
        self.checkpoints = Checkpointing(folder, t.checkpoint_every, self)
        self.memory_count = MemoryCount(self.net, self.optimizer, self.sync, self.context)
        self.participants = self._participants(wrapped.mixture_grads)
        self.val_scores = (Accuracy(len(self.classes), self._dp_reduce, dims.device) if self.classes
                           else ValidationScores())
        self.scoring = Scoring(cfg, dims, folder, self.net, self.precision, self.pairs, self.whole_logits,
                               self.model_config, self.pipeline, self.micro_batch)

    def _participants(self, mixture_grads: ShardedMixtureGradients | None) -> list[Participant]:
        """The optional parts of this run's step, in the order the step calls them: the memory is counted and the
        gradients dumped before any part resets gradients."""
        dump = self.cfg.train.dump_grads
        return [self.memory_count,
                *([GradientDump(self.net, dump, self.total_steps, self.dims.rank)] if dump else []),
                *([ExpertGradients(self.experts)] if self.experts is not None else []),
                *([MixtureGradients(mixture_grads)] if mixture_grads is not None else [])]

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = model_state(self.net, self.optimizer, self.sync)
        for layout in self.state_layouts:
            model, optimizer = layout.save(model, optimizer)
        comm = self.sync.comm_state()
        return {"model": model, "optimizer": optimizer, "step": self.step, "vocab_size": self.vocab_size,
                **self.precision.state_dict(), **({"comm": comm} if comm else {})}

    def checkpoint_name(self, name: str) -> str:
        """A parameter's name in a checkpoint of any layout as the one-process model's (`reshard` matches by it); a
        tied LM head's as the token table's, which a pipeline's last stage holds a copy of."""
        name = model_name(name, self.arch)
        return f"model.{self.arch.token_table}" if self.tied and name == "model.lm_head.weight" else name

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model, optimizer = state["model"], state["optimizer"]
        for layout in self.state_layouts:
            model, optimizer = layout.load(model, optimizer)
        load_model_state(self.net, self.optimizer, model, optimizer, self.sync)
        self.step = int(state["step"])
        self.precision.load_state_dict(state)
        self.sync.load_engine(self.folder.path, self.step)
        if "comm" in state:
            self.sync.load_comm_state(state["comm"])

    def batches(self, epoch: int, skip_steps: int) -> Iterator[list[Batch]]:
        """The epoch's optimizer steps, each a list of grad_accum micro-batches; resumed steps are skipped. On a GPU
        each step's batches are pinned and their copies to the device queued (non-blocking) one step ahead: the
        host never waits for a copy, and the next step's inputs are on their way while this step computes."""
        device = self.dims.device
        steps = replica_steps(self.train_set, self.collate, self.dims.coord("dp"), self.dims.size("dp"),
                              self.cfg.train, epoch, skip_steps, self.steps_per_epoch)
        if device.type != "cuda":
            yield from steps
            return
        ahead: list[Batch] | None = None
        for chunk in steps:
            on_device = [tuple(t.pin_memory().to(device, non_blocking=True) for t in batch) for batch in chunk]
            if ahead is not None:
                yield ahead
            ahead = on_device
        if ahead is not None:
            yield ahead

    def _dp_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel replicas, in place (one small all-reduce; no host wait)."""
        if self.dp_group is not None:
            with comm_span("all_reduce", group=self.dp_group, nbytes=tensor.nbytes):
                dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def _dp_sum(self, *values: float) -> list[float]:
        """Scalars summed over the data-parallel replicas (one small all-reduce)."""
        if self.dp_group is None:
            return list(values)
        return self._dp_reduce(torch.tensor(values, dtype=torch.float64, device=self.dims.device)).tolist()

    def _dp_mean(self, value: float) -> float:
        """The mean of a scalar over the data-parallel replicas."""
        return self._dp_sum(value)[0] / self.dims.replicas()

    def _target_share(self, micro_batches: list[Batch]) -> float:
        """N / R: the step's target tokens on all R replicas (one small all-reduce), per replica."""
        return self._dp_sum(sum(target_tokens(batch[1]) for batch in micro_batches))[0] / self.dims.replicas()

    def _loss_divisors(self, micro_batches: list[Batch]) -> list[float]:
        """What each micro-batch's mean loss is divided by so that the step's gradient, once the sync has averaged
        it over the R replicas, is that of the mean over every token of the step: the micro-step count for blocks
        of equal size; for translation, whose micro-batches hold different numbers n_i of target tokens (N in the
        step over all replicas), N / (R n_i). A rank's loss is then R times its share of the global mean, and the
        mean over ranks is the token-weighted mean, whatever the split."""
        if self.pairs is None:
            return [len(micro_batches)] * len(micro_batches)
        share = self._target_share(micro_batches)
        return [share / count if (count := target_tokens(batch[1])) else math.inf for batch in micro_batches]

    def _chunk_weight(self, micro_batches: list[Batch]) -> Weight | None:
        """`_loss_divisors` for the pipeline engine, which cuts micro-batches into chunks of its own: None (equal
        shares) for blocks; for pair rows a chunk's n target tokens over N / R, as a multiplier (under context
        parallelism both counted on the cp shards, so N counts each row's targets once)."""
        if self.pairs is None:
            return None
        share = self._target_share(micro_batches)
        return lambda labels: target_tokens(labels) / share

    def forward_backward_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """The step's mean-loss gradients into .grad (not yet reduced); returns the loss (a pipeline's on every
        stage), a float64 scalar left where it was computed. The data-parallel sync may reduce during the last
        micro-step's backward, a pipeline's only in finish(), after the last micro-batch's backward on each stage."""
        precision = self.precision
        if self.pipeline:
            shards = self._shards(micro_batches)  # a chunk's weight is counted on the shards its stages run
            with self.sync.accumulating(is_last_micro_step=False), record_function("forward_backward"), \
                    self._sharded():
                return torch.tensor(self.net.train_step(shards, precision.loss_scale, precision.autocast,
                                                        self._chunk_weight(shards)), dtype=torch.float64)
        rows = micro_batches
        micro_batches = self._shards(rows)
        losses, divisors = [], self._loss_divisors(micro_batches)
        for i, batch in enumerate(micro_batches):
            RECORDER.micro_step = i
            with self.sync.accumulating(is_last_micro_step=i == len(micro_batches) - 1), self.loss_context(), \
                    self._sharded(rows[i]):
                with record_function("forward"), precision.autocast():
                    with self._routing():
                        logits = self._logits(self.sync.module, batch)
                    labels = batch[1].to(logits.device, non_blocking=True)
                    loss = micro_loss(self.loss_fn, logits, labels, divisors[i])
                    if self.router_load is not None:  # the router's load-balancing loss, a mean over micro-steps
                        aux = self.router_load.aux_loss(labels)
                        loss = loss + self.cfg.model.moe_aux_loss_coef * aux / len(micro_batches)
                with record_function("backward"):
                    self.sync.backward(precision.scale(loss))
            losses.append(loss.detach())
        return torch.stack(losses).double().sum()

    def _positions(self, inputs: torch.Tensor) -> int:
        """The positions a micro-batch runs (its step record's tokens): every token id, translation's padding too,
        or an image's patches and class token."""
        return inputs.size(0) * example_width(self.cfg) if self.classes else inputs.numel()

    def _shards(self, micro_batches: list[Batch]) -> list[Batch]:
        """This rank's share of each row under context parallelism, each token with its position id (its row's or
        its packed example's) for the whole model; a model run as pieces (tensor or pipeline parallelism) asks the
        ContextParallel for them."""
        if self.context is None:
            return micro_batches
        pieces = self.pipeline or self.tp_group is not None
        return [self.context.shard(batch, with_positions=not pieces) for batch in micro_batches]

    def _sharded(self, rows: Batch | None = None) -> AbstractContextManager[None]:
        """Where attention meets the other cp ranks' shards: the training forward (and its backward's ring) of the
        micro-batch's whole `rows` (packed rows bring their position ids, which keep examples apart)."""
        if self.context is None:
            return contextlib.nullcontext()
        packed = rows is not None and len(rows) > 2
        return self.context.sharded(rows[2].to(self.net.input_device, non_blocking=True) if packed else None)

    def _routing(self) -> AbstractContextManager[None]:
        """Where a mixture's routers are watched: the training forward (not evaluation or decoding)."""
        return self.router_load.recording() if self.router_load is not None else contextlib.nullcontext()

    def _logits(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """The batch's logits from `module` (the net, or the sync's wrapper of it); packed rows bring their position
        ids, which the model also masks attention with."""
        return module(*(t.to(self.net.input_device, non_blocking=True) for t in (batch[0], *batch[2:])))

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on the step's micro-batches: the learning rate, forward and backward, the sync, the
        clipped global norm, the optimizer (skipped on an fp16 overflow); returns (loss, grad norm) as scalar
        tensors left on the device: nothing in the step waits for the device (fp16's overflow check aside), and
        the loop reads them every log.sync_every steps (gptpar.train.step_records)."""
        t = self.cfg.train
        lr = learning_rate(self.step, t, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.net.train()
        self.precision.set_matmul_precision()
        total = self.forward_backward_step(micro_batches)
        self.sync.finish()
        for part in self.participants:
            part.after_backward()
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        targets, groups, counted = self._norm_plan()
        # An fp16 overflow skips the step on every rank: the data is consumed and the lr moves on, the weights not.
        grad_norm = torch.tensor(math.inf)
        if self.precision.unscale(targets):
            grad_norm = self.sync.step(self.optimizer, lambda: clip_gradients(targets, max_norm, groups, counted))
        for part in self.participants:
            part.after_optimizer(self.step + 1)
        self.sync.zero_grad()
        return total, grad_norm

    @property
    def memory(self) -> dict[str, int] | None:
        """The training state's bytes, counted at this start's first step (None before it)."""
        return self.memory_count.counted

    def _norm_plan(self) -> tuple[list[torch.Tensor], list[dist.ProcessGroup], list[torch.Tensor] | None]:
        """The gradients of the global norm, the groups over which their squares are summed, and the ones this rank
        counts (None: all): a pipeline's stages sum over the pp group, the tied embedding counted once; a sharding
        sync's shards over its dp group; our tensor-parallel pieces over the tp group, replicated tensors once."""
        if self.pipeline:
            self.net.sum_tied_gradients()
            targets = [p for p in self.net.parameters() if p.grad is not None]
            groups, counted = [self.dims.group("pp")], self.net.counted_parameters()
        else:
            (targets, group), counted = self.sync.clip_targets(), None
            groups = [group] if group is not None else []
        over_replicas = bool(groups) and not self.pipeline  # a sync's gradients sharded over its dp group
        if self.checkpoint_layout is not None:  # our tensor-parallel pieces
            owners, tp_rank = self.sync.owners(), self.dims.coord("tp")
            counted = [t for t in (targets if counted is None else counted)
                       if counts_in_norm(owners.get(id(t), t), tp_rank)]
            groups.append(self.tp_group)
        if self.experts is not None and self.experts.sharded:  # expert slices over the ep group, or over dp
            counted = self.experts.counted(targets if counted is None else counted, over_replicas)
            if not over_replicas:
                groups.append(self.dims.group("ep"))
        return targets, groups, counted

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches of every replica's shard, averaged over replicas
        (for translation weighted by target tokens, which differ from batch to batch)."""
        replicas = self.dims.size("dp")
        batch = min(self.micro_batch, len(self.val_set) // replicas * replicas)
        self.val_scores.reset()
        if batch < replicas:
            return None
        self.net.eval()
        self.precision.set_matmul_precision()
        loader = partition_dataset(self.dims.coord("dp"), replicas, self.val_set, batch, self.collate, seed=0, epoch=0)
        batches = list(islice(loader, self.cfg.train.eval_batches))
        with self.precision.autocast(), self.loss_context():
            if self.pipeline:
                weight = target_tokens if self.pairs is not None else by_rows
                losses = [self.net.eval_loss(x, y, weight) for x, y in batches]
            else:
                losses = [self._val_loss(batch) for batch in batches]
        if self.pairs is not None:
            counts = [target_tokens(batch[1]) for batch in batches]
            loss_sum, count = self._dp_sum(sum(loss * n for loss, n in zip(losses, counts, strict=True)), sum(counts))
            return loss_sum / count
        return self._dp_mean(sum(losses) / len(losses))

    def _val_loss(self, batch: Batch) -> float:
        """A validation batch's loss; its logits are scored too (`val_scores`: classify's accuracy)."""
        logits = self._logits(self.net, batch)
        labels = batch[1].to(logits.device)
        self.val_scores.observe(logits, labels)
        return self.loss_fn(logits, labels).item()

    def banner(self) -> str:
        """What is about to train, where, from which step (rank 0 prints it before the first step)."""
        layout = " x ".join(f"{dim}={self.dims.size(dim)}" for dim in GRID_DIMS) + (
            f", ep={self.dims.size('ep')}" if self.dims.size("ep") > 1 else "")
        g = self.model_config
        return (f"gptpar: {self.dims.world_size} rank(s) ({layout}) on {self.dims.device} ({self.dims.backend}); "
                f"{architecture(g).title} of {self.n_params:,} parameters ({g.num_hidden_layers} layers, width "
                f"{g.hidden_size}, {g.num_attention_heads} heads); {self._lora_banner()}"
                f"{self._data_words()}; "
                f"{self.capped + '; ' if self.capped else ''}{self.precision.name}; "
                f"steps {self.step + 1}-{self.total_steps}")

    def _data_words(self) -> str:
        """What the model reads, as the banner says it: an image classifier's classes, or the tokenizer."""
        g = self.model_config
        if self.classes:
            return f"{len(self.classes)} classes of {g.image_size}-pixel images"
        table = f", token table of {g.vocab_size:,} rows" if g.vocab_size > self.vocab_size else ""
        return f"tokenizer {self.tokenizer} (vocab {self.vocab_size}{table})"

    def _lora_banner(self) -> str:
        lora = self.lora()
        return "" if lora is None else (f"LoRA rank {lora['rank']} on {', '.join(lora['targets'])}: "
                                        f"{lora['trainable']:,} parameters train; ")

    def lora(self) -> dict[str, Any] | None:
        """What the log header records of train.lora_rank: the adapters' rank and targets, the parameters that
        train, and the training state's closed form on this rank (bytes: frozen weights 4 each; trainable ones 16:
        weight, gradient and AdamW's two moments, sharded as parallel.dp_sync shards them over the dp x cp replicas);
        None without LoRA."""
        t = self.cfg.train
        if not t.lora_rank:
            return None
        chosen = DP_STRATEGIES[self.cfg.parallel.dp_sync]
        synced = chosen.syncs(self.dims.replicas(), self.cfg.parallel.offload)
        row = chosen if synced else DP_STRATEGIES["naive"]
        targets = lora_targets(self.model_config.model_type, t.lora_targets)
        return {"rank": t.lora_rank, "alpha": t.lora_alpha, "targets": targets,
                "trainable": self.n_trainable, "params": self.n_params,
                "state_bytes": int(row.state_bytes(self.n_params, self.dims.replicas(), self.cfg.parallel.offload,
                                                   trainable=self.n_trainable))}

    def fast_path(self) -> dict[str, Any]:
        """What the log header records of the fast path as it resolved on this rank."""
        # an image classifier's head has a row per class (its config has no vocab_size)
        rows = getattr(self.model_config, "vocab_size", self.vocab_size)
        return {"optimizer": kind_of(self.optimizer), "vocab_rows": rows,
                "sync_every": sync_every(self.cfg.log.sync_every, self.dims.device),
                "compile": compile_mode(self.cfg, self.dims.device),
                "loss": "vocabulary-parallel" if self.cfg.parallel.loss_parallel and self.dims.size("tp") > 1
                else loss_kernel(self.cfg, self.dims.device)}

    @property
    def computes_loss(self) -> bool:
        """False on a pipeline stage that does not compute the loss."""
        return not self.pipeline or self.net.computes_loss

    def logged_loss(self, loss: float | None) -> float | None:
        """The loss as this rank's log reports it: a pipeline stage that does not compute it says null."""
        return loss if self.computes_loss else None

    def _stop_status(self) -> str | None:
        """A stop asked for on any rank (gptpar.train.preemption) stops every rank at the same step:
        "requeued" (USR2) wins over "stopped" (TERM, INT); None to go on."""
        request = stop_request()
        outcomes = (None, "stopped", "requeued")
        flag = torch.tensor([float(outcomes.index(request[0] if request else None))], device=self.dims.device)
        if self.dims.world_size > 1:
            with comm_span("all_reduce", nbytes=flag.nbytes):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return outcomes[int(flag.item())]

    def _timed_step(self, batches: Iterator[list[Batch]], epoch: int) -> PendingStep:
        """The next step, from fetching its micro-batches to its global loss (every rank's clock stops after the
        same collectives), its numbers (loss, global loss, grad norm) and time still on the device."""
        new_step(self.step + 1, self.dims.device)
        clock, device = DeviceClock(self.dims.device), self.dims.device
        start = time.perf_counter()
        micro_batches = next(batches)
        data_time = time.perf_counter() - start
        loss, grad_norm = self.train_step(micro_batches)
        global_loss = self._dp_reduce(loss.to(device, torch.float64, copy=True)) / self.dims.replicas()
        clock.stop()
        waited = WAITING.read()  # before the fields below, whose collectives (a mixture's load) are not the step's
        self.step += 1
        tokens = sum(self._positions(batch[0]) for batch in micro_batches)
        pipeline = self.net.step_fields() if self.pipeline else {}
        moe = self.router_load.step_fields() if self.router_load is not None else {}
        sent, spent = read_sent(), read_spent()
        fields = dict(step=self.step, epoch=epoch, lr=self.optimizer.param_groups[0]["lr"],
                      skipped=self.precision.skipped, loss_scale=self.precision.step_scale, tokens=tokens,
                      data_time_s=data_time, peak_mem_bytes=peak_memory_bytes(device), bubble=self.net.bubble,
                      **pipeline, **moe, **({"comm_bytes": sent} if sent else {}),
                      **({"comm_s": Spans(spent)} if spent else {}))
        values = torch.stack([t.to(device, torch.float64) for t in (loss, global_loss, grad_norm)])
        return PendingStep(values, clock, fields, has_loss=self.computes_loss, waited=waited)

    def run(self) -> tuple[str, float | None]:
        """Train from the last checkpoint to the end, or until a stop is asked for (gptpar.train.preemption);
        returns (status, last loss): completed, stopped or requeued. The components decide their own cadence.
        Step records are fetched from the device every log.sync_every steps, and before an evaluation, a
        checkpoint or an epoch's end, so the log keeps its order; a stop is agreed on at those fetches."""
        cfg, dims = self.cfg, self.dims
        progress = Progress(cfg.log, dims.rank, dims.world_size, self.total_steps, self.step)
        progress.message(self.banner())
        metrics = Metrics(self.log, progress, dims.size("dp"))
        self.scoring.progress = progress
        evaluation = Evaluation(cfg.train.eval_every, self.evaluate, self.val_scores.scores, self.scoring.scores,
                                self.log, progress)
        profiler = StepProfiler(cfg.train, dims.device, self.folder.trace_path(dims.rank))
        pending = PendingSteps(lambda values: gather_to_first(values, dims.device))
        every = sync_every(cfg.log.sync_every, dims.device)
        status, loss = "completed", math.nan

        def write_pending() -> None:
            nonlocal loss
            for record in pending.fetch():
                metrics.after_step(record, self.memory)
                loss = record.loss

        try:
            while self.step < self.total_steps and status == "completed":
                epoch = self.step // self.steps_per_epoch
                metrics.begin_epoch(self.step)
                batches = self.batches(epoch, self.step - epoch * self.steps_per_epoch)
                while self.step < min(self.total_steps, (epoch + 1) * self.steps_per_epoch):
                    # At a step boundary where records are fetched, never after the last step.
                    if self.step % every == 0 and (stop := self._stop_status()) is not None:
                        status = stop
                        break
                    profiler.begin(self.step + 1)
                    pending.add(self._timed_step(batches, epoch))
                    profiler.end(self.step)
                    if self.step % every == 0 or evaluation.due(self.step) or self.checkpoints.due(self.step):
                        write_pending()
                    evaluation.after_step(self.step, epoch)
                    self.checkpoints.after_step(self.step)
                write_pending()
                if status == "completed" and metrics.epoch_steps(self.step):
                    metrics.end_epoch(epoch, self.step, evaluation.at_epoch_end(epoch))
            self.checkpoints.save()
        finally:
            progress.close()
            profiler.close()  # a run stopped inside the profiled steps keeps what was recorded
        return status, loss

