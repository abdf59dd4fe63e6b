"""The multi-process pipeline engine: each rank runs its stages of GPT-2 and executes its schedule's actions.

The rank's action list comes from `schedules.schedule` (the same lists the simulator and `gptpar schedule
show` run), so what is measured is what was planned. Activations and their gradients travel with
torch.distributed point-to-point messages between the ranks of the grid's `pp` group:

- Shapes are known ahead: a stage's input is (micro-batch rows, seq_len, n_embd), derived from the batch
  every rank of a replica loads itself (translation pads every batch to one width for it). No rank ever asks
  another for a shape.
- Each run of consecutive send/receive actions is posted as one `batch_isend_irecv` (on NCCL one group
  call, so a send and the receive beside it cannot wait on each other); receives are waited for before
  the compute that needs them, sends only at the end of the step. Sends and receives of one pair of
  ranks come in the same order on both sides (tests/test_schedules.py checks every schedule), because
  NCCL matches messages by order, not by tag.
- A mixture of experts' router statistics travel beside the hidden states (`Routing`): each stage adds its layers'
  picks and routing-probability sums to what the micro-batch carries, the last stage forms the load-balancing loss
  from the sums as one process does and adds it to the loss it backpropagates, and the sums' gradient goes back
  with the hidden states' gradient (gptpar.train.moe). Their size is known ahead too.
- The tied embedding/LM-head matrix has a copy on the first and on the last stage; `sum_tied_gradients`
  adds the two copies' gradients each step, as Megatron-LM does, so both copies take the same update and
  stay equal: the pipeline trains like one process.
- Per step the engine records each compute action's span, the busy time per kind (F, B, W), and the
  bytes autograd saves in forward that a rank holds at once, so the bubble is measured, not assumed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from transformers import PreTrainedModel

from gptpar.config import Config, example_width
from gptpar.models import architecture
from gptpar.models.loss import no_target_loss
from gptpar.parallel.comm import comm_span
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.flight import Peer, name_group
from gptpar.parallel.pipeline.cuts import balanced_sizes
from gptpar.parallel.pipeline.engine.split_backward import WeightGradStore, apply_weight_grads, make_deferrable
from gptpar.parallel.pipeline.engine.stages import PipelineStage, pipeline_stages
from gptpar.parallel.pipeline.names import original_name
from gptpar.parallel.process_group import new_group
from gptpar.strategies.pipeline import COMPUTE, Action, pp_split_counts, schedule
from gptpar.tensor_bytes import SavedBytes

Batch = tuple[torch.Tensor, torch.Tensor]
Key = tuple[int, int]  # (micro-batch, stage)
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, labels) -> mean loss
Weight = Callable[[torch.Tensor], float]  # a chunk's weight in a mean loss, from its labels


class Routing(Protocol):
    """A mixture's router statistics as a pipeline micro-batch carries them (gptpar.train.moe.RouterLoad)."""

    carried_size: int

    def recording(self) -> AbstractContextManager[None]: ...

    def carry(self, labels: torch.Tensor, carried: torch.Tensor | None = None) -> torch.Tensor: ...

    def aux_loss(self, labels: torch.Tensor, carried: torch.Tensor | None = None) -> torch.Tensor: ...


def by_rows(labels: torch.Tensor) -> float:
    """Each row weighs the same: the mean over equal-length language-model blocks."""
    return labels.size(0)


@dataclass
class StepStats:
    """What one rank did in its last step: compute spans relative to the step's start, and the window
    from the start until every stage of the pipeline was done (the loss exchange ends it)."""

    spans: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # kind, mb, stage, start, end
    window_s: float = 0.0
    peak_activation_bytes: int = 0

    def busy(self) -> dict[str, float]:
        return {kind: sum(end - start for k, _, _, start, end in self.spans if k == kind) for kind in COMPUTE}

    @property
    def bubble(self) -> float | None:
        """The idle share of the window: waiting for and exchanging messages, and the pipeline's fill and drain."""
        if self.window_s <= 0:
            return None
        return max(0.0, 1.0 - sum(self.busy().values()) / self.window_s)


def tied_group(grid: ParallelDims) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline's first and last stage (same dp and tp coordinates), which hold
    the two copies of the tied embedding. Every rank creates every pair's group, in the same order."""
    stride = grid.world_size // grid.size("pp")
    last = (grid.size("pp") - 1) * stride
    mine = None
    for base in range(stride):
        group = new_group([base, base + last])
        if grid.rank in (base, base + last):
            mine = group
    return mine


class PipelineEngine(nn.Module):
    """This rank's pipeline stages and its schedule. `stages` holds the stage modules (the optimizer's and
    checkpoint's parameters); `train_step` runs one optimizer step's forwards and backwards and returns the
    pipeline's loss on every rank; `computes_loss` says whether this rank is the one that computed it. `loss_fn` is
    the caller's loss of the last stage's output and the labels (whole logits, or tensor parallelism's vocabulary
    shards), so the engine needs no other parallelism's code; `routing`, a mixture's router statistics carried with
    each micro-batch, whose load-balancing loss (times `aux_coef`) the last stage adds to its loss."""

    def __init__(self, model: PreTrainedModel, cfg: Config, grid: ParallelDims, device: torch.device,
                 loss_fn: Loss, routing: Routing | None = None, aux_coef: float = 0.0) -> None:
        super().__init__()
        p = cfg.parallel
        self.ranks, self.virtual, self.chunks = p.pp, p.pp_virtual, p.chunks
        self.rank = grid.coord("pp")
        self.peers = grid.group_ranks("pp")  # global rank of each pipeline rank
        self.pp_group = grid.group("pp")
        self.device = self.input_device = self.output_device = device
        self.stage_devices = [device]
        self.n_stages = p.pp * p.pp_virtual
        self.width = model.config.hidden_size
        self.arch = architecture(model)
        tied = model.config.tie_word_embeddings  # before the stages untie it
        self.seq_shards = p.tp if p.tp > 1 and p.sequence_parallel else 1  # stages exchange sequence shards
        self.loss_fn, self.routing, self.aux_coef = loss_fn, routing, aux_coef
        replica_batch = cfg.train.batch_size // (p.dp * cfg.train.grad_accum)
        sizes = (pp_split_counts(p.pp_split, p.pp * p.pp_virtual)
                 or self._balanced(model, cfg, replica_batch // p.chunks, device))
        self.stage_ids = [self.rank + k * p.pp for k in range(p.pp_virtual)]
        self.stages = nn.ModuleDict({str(s): stage.to(device) for s, stage in
                                     zip(self.stage_ids, pipeline_stages(model, self.stage_ids, sizes), strict=True)})
        self.blocks_per_stage = sizes
        self.actions = schedule(p.pp_schedule, p.pp, p.chunks, p.pp_virtual)[self.rank]
        self.split_backward = any(a.kind == "W" for a in self.actions)
        self.store = WeightGradStore()
        if self.split_backward:
            make_deferrable(self.stages, self.store)
        # The dtype of the activations sent between stages: the parameters', which autocast leaves unchanged. The
        # residual stream stays in it under bf16/fp16 autocast too; senders cast to it, so receive buffers always fit.
        self.dtype = next(self.stages.parameters()).dtype
        self.computes_loss = str(self.n_stages - 1) in self.stages
        self.tied = tied_group(grid) if tied else None
        name_group(self.tied, "tied")  # the flight recorder's name
        # This rank's copy of the tied matrix, if it has one (a name: an attribute would register it twice).
        self.tied_name = None if not tied else (
            f"stages.0.embed.{self.arch.embedding}.weight" if "0" in self.stages else
            f"stages.{self.n_stages - 1}.head.lm_head.weight" if self.computes_loss else None)
        self.stats = StepStats()

    def _balanced(self, model: PreTrainedModel, cfg: Config, micro_rows: int, device: torch.device) -> list[int]:
        """Blocks per stage; rank 0 decides and tells the others, so a measured split is one split."""
        choice: list[Any] = [None]
        if dist.get_rank() == 0:
            choice[0] = balanced_sizes(model, self.n_stages, cfg.parallel.balance, separate_head=True,
                                       sample=(max(1, micro_rows), example_width(cfg)), device=device)
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _stage(self, index: int) -> PipelineStage:
        return self.stages[str(index)]  # type: ignore[return-value]

    def original_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under their names in one model (a tied head's copy as lm_head.weight)."""
        return {original_name(n, self.arch): p for stage in self.stages.values() for n, p in stage.named_parameters()}

    @property
    def tied_weight(self) -> nn.Parameter | None:
        return self.get_parameter(self.tied_name) if self.tied_name else None

    def counted_parameters(self) -> list[nn.Parameter]:
        """Parameters as the global gradient norm counts them: the tied matrix once (on the first stage)."""
        skip = self.tied_weight if "0" not in self.stages else None
        return [p for p in self.parameters() if p is not skip]

    def sum_tied_gradients(self) -> None:
        """Give both copies of the tied embedding the sum of their gradients (after the data-parallel sync)."""
        if self.tied_weight is not None and self.tied_weight.grad is not None:
            with comm_span("all_reduce", group=self.tied, nbytes=self.tied_weight.grad.nbytes):
                dist.all_reduce(self.tied_weight.grad, group=self.tied)

    @property
    def bubble(self) -> float | None:
        return self.stats.bubble

    def step_fields(self) -> dict[str, Any]:
        """The step record's pipeline fields (see docs/log_schema.md)."""
        s = self.stats
        return {"pp_busy_s": s.busy(), "pp_window_s": s.window_s, "pp_peak_activation_bytes": s.peak_activation_bytes,
                "pp_timeline": [[k, mb, st, round(a, 6), round(b, 6)] for k, mb, st, a, b in s.spans]}

    # --- one step ---------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[Batch], loss_scale: float = 1.0,
                   autocast: Callable[[], AbstractContextManager] = nullcontext, weight: Weight | None = None
                   ) -> float:
        """Forwards and backwards of every micro-step's batch through the schedule; .grad holds the
        gradient of the mean loss times `loss_scale` (fp16's, not yet averaged over replicas); each forward runs
        under `autocast()` (a new context each time), backwards outside it. Each chunk's mean loss counts `weight`
        of its labels (translation: its share of the step's target tokens), by default an equal share
        1 / (micro-steps * chunks), which a mixture's load-balancing loss always counts (a chunk is its
        micro-step). Returns the (unscaled) loss on every rank."""
        self.train()
        self.stats = StepStats()
        start = time.perf_counter()
        equal = 1.0 / (len(micro_batches) * self.chunks)
        weight = weight or (lambda _labels: equal)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in micro_batches:
            total += self._run_schedule(x, y, weight, start, loss_scale, autocast, equal)
        loss = self._share(total)
        self.stats.window_s = time.perf_counter() - start
        return loss

    def _run_schedule(self, x: torch.Tensor, y: torch.Tensor, weight: Weight, start: float, loss_scale: float,
                      autocast: Callable[[], AbstractContextManager], aux_weight: float) -> torch.Tensor:
        xs = x.to(self.device, non_blocking=True).chunk(self.chunks)
        ys = y.to(self.device, non_blocking=True).chunk(self.chunks)
        scales = [weight(labels) for labels in y.chunk(self.chunks)]  # on the host: no device sync in the schedule
        shape = (xs[0].size(0), xs[0].size(1) // self.seq_shards, self.width)
        # Per (micro-batch, stage): what a stage receives and sends, hidden states first, then what `routing`
        # carries; a last stage's output is its loss.
        inputs: dict[Key, list[torch.Tensor]] = {}
        outputs: dict[Key, list[torch.Tensor]] = {}
        out_grads: dict[Key, list[torch.Tensor]] = {}
        deferred: dict[Key, list] = {}
        saved: dict[Key, int] = {}
        sends: list[dist.Work] = []
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        i = 0
        while i < len(self.actions):
            action = self.actions[i]
            if action.kind not in COMPUTE:
                j = i
                while j < len(self.actions) and self.actions[j].kind not in COMPUTE:
                    j += 1
                sends += self._exchange(self.actions[i:j], shape, inputs, outputs, out_grads)
                i = j
                continue
            key, began = (action.microbatch, action.stage), time.perf_counter()
            stage = self._stage(action.stage)
            with record_function(f"pp:{action.kind} mb={action.microbatch} stage={action.stage}"):
                if action.kind == "F":
                    inp = [xs[action.microbatch]] if stage.is_first else inputs[key]
                    inputs[key] = inp
                    labels = ys[action.microbatch]
                    with SavedBytes(self.stages.parameters()) as counter, autocast(), self._recording():
                        out = [stage(inp[0])]
                        if self.routing is not None:
                            out.append(self.routing.carry(labels, inp[1] if len(inp) > 1 else None))
                        if stage.is_last:
                            scale = scales[action.microbatch]  # 0: a cp shard of pair rows with no target
                            loss = self.loss_fn(out[0], labels) * scale if scale else no_target_loss(out[0])
                            if self.routing is not None:
                                loss = loss + self.aux_coef * aux_weight * self.routing.aux_loss(labels, out[1])
                            total += loss.detach()
                            out = [loss * loss_scale]
                    outputs[key] = out
                    saved[key] = counter.total
                    self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, sum(saved.values()))
                elif action.kind == "B":
                    self.store.deferring = self.split_backward
                    out, grads = outputs.pop(key), None if stage.is_last else out_grads.pop(key)
                    kept = [i for i, tensor in enumerate(out) if tensor.requires_grad]  # a stage with no router
                    torch.autograd.backward([out[i] for i in kept], None if grads is None else [grads[i] for i in kept])
                    self.store.deferring = False
                    if self.split_backward:
                        deferred[key] = self.store.take()
                    else:
                        saved.pop(key)
                else:  # W
                    apply_weight_grads(deferred.pop(key))
                    saved.pop(key)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # spans time the work, not its launch
            self.stats.spans.append((action.kind, action.microbatch, action.stage, began - start,
                                     time.perf_counter() - start))
            i += 1
        for work in sends:
            with comm_span("send", phase="wait", group=self.pp_group):
                work.wait()
        return total

    def _recording(self) -> AbstractContextManager[None]:
        return self.routing.recording() if self.routing is not None else nullcontext()

    def _message(self, shape: tuple[int, int, int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """What one message between stages holds, shape and dtype: the hidden states (or their gradient) and what
        `routing` carries (or its gradient), in fp32 whatever the precision."""
        routed = [((self.routing.carried_size,), torch.float32)] if self.routing is not None else []
        return [(shape, self.dtype), *routed]

    def _exchange(self, actions: list[Action], shape: tuple[int, int, int], inputs: dict[Key, list[torch.Tensor]],
                  outputs: dict[Key, list[torch.Tensor]], out_grads: dict[Key, list[torch.Tensor]]
                  ) -> list[dist.Work]:
        """Post a run of sends and receives together (each a message's tensors, in one order on both sides); wait
        for the receives, return the sends' handles."""
        ops, kinds, peers, received = [], [], [], []
        for a in actions:
            key = (a.microbatch, a.stage)
            if a.kind == "SEND_F":  # what the receiver allocated
                hidden, *carried = outputs[key]
                tensors = [hidden.detach().to(self.dtype).contiguous(), *(t.detach().contiguous() for t in carried)]
            elif a.kind == "SEND_B":  # a carried sum no router used still answers, with zeros
                tensors = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs.pop(key)]
            else:
                tensors = [torch.empty(size, dtype=dtype, device=self.device) for size, dtype in self._message(shape)]
                received.append((a, tensors))
            for tensor in tensors:
                ops.append(dist.P2POp(dist.isend if a.kind.startswith("SEND") else dist.irecv, tensor,
                                      self.peers[a.peer]))
                kinds.append(a.kind[:4].lower())
                peers.append(Peer(self.peers[a.peer], tensor.nbytes, a.microbatch))
        with comm_span(*kinds, phase="issue", group=self.pp_group, peers=peers):  # "send" or "recv", one per op
            works = dist.batch_isend_irecv(ops)
        sends = [w for w, kind in zip(works, kinds, strict=True) if kind == "send"]
        for w, kind in zip(works, kinds, strict=True):
            if kind == "recv":
                with comm_span("recv", phase="wait", group=self.pp_group):
                    w.wait()
        for a, tensors in received:
            if a.kind == "RECV_F":
                inputs[(a.microbatch, a.stage)] = [t.requires_grad_() for t in tensors]
            else:
                out_grads[(a.microbatch, a.stage)] = tensors
        return sends

    def _share(self, total: torch.Tensor) -> float:
        """The loss, computed on the last stage, on every rank of the pipeline (this exchange also ends the
        step's window: no rank leaves it before the last stage is done)."""
        if self.pp_group is not None:
            with comm_span("all_reduce", group=self.pp_group, nbytes=total.nbytes):
                dist.all_reduce(total, group=self.pp_group)
        return float(total.item())

    # --- evaluation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, weight: Weight = by_rows) -> float:
        """Mean loss of a batch, forward only: micro-batch after micro-batch, stage after stage; each micro-batch's
        mean weighted by `weight` of its labels (rows; translation: target tokens)."""
        self.eval()
        x, y = x.to(self.device), y.to(self.device)
        rows = max(1, math.ceil(x.size(0) / self.chunks))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        sends: list[dist.Work] = []
        for mb, (xm, ym) in enumerate(zip(x.split(rows), y.split(rows), strict=True)):
            for s in self.stage_ids:
                stage = self._stage(s)
                if stage.is_first:
                    hidden = xm
                else:
                    hidden = torch.empty(xm.size(0), xm.size(1) // self.seq_shards, self.width, dtype=self.dtype,
                                         device=self.device)
                    source = self.peers[(s - 1) % self.ranks]
                    with comm_span("recv", group=self.pp_group, peers=[Peer(source, hidden.nbytes, mb)]):
                        dist.recv(hidden, source)
                out = stage(hidden)
                if stage.is_last:
                    total += self.loss_fn(out, ym).double() * weight(ym)
                else:
                    sent, dest = out.to(self.dtype).contiguous(), self.peers[(s + 1) % self.ranks]
                    with comm_span("send", phase="issue", group=self.pp_group, peers=[Peer(dest, sent.nbytes, mb)]):
                        sends.append(dist.isend(sent, dest))
        for work in sends:
            with comm_span("send", phase="wait", group=self.pp_group):
                work.wait()
        return self._share(total) / weight(y)

