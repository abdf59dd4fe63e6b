"""A mixture of experts' routers, watched: the load-balancing loss the training loss adds, and the expert load the
step record carries.

The loss is transformers' (Switch Transformer's): over every layer's routed positions, f_e the top-k picks that
went to expert e per position and P_e its mean routing probability, aux = E · Σ_e f_e · P_e (k when perfectly
balanced, as f sums to k; up to E · k when one expert takes every pick with certainty). Both are means over
positions, so the product is not a sum of per-rank parts: f and P are summed over every replica's positions of the
micro-step first (one small all-reduce), which makes each replica's aux the one process's of the same tokens. A
replica's gradient is that of its own positions' share; data parallelism then averages gradients over R replicas,
so the term a rank backpropagates is R times its value (as the LM loss's is). Nothing here waits for the device:
the counts stay there, and the step record reads them with the step's loss (gptpar.train.step_records).

Only real positions count: a pair task's right padding (every position after a row's last predicted label) routes
too, but is left out, so the loss does not depend on how wide a layout pads its batches.

Under the multi-process pipeline each stage runs only some layers, so the statistics travel with the micro-batch:
beside its hidden states a stage sends the running sums so far (`carry`: picks per layer and expert and dropped
picks, which need no gradient, and the routing-probability sums, which do), the last stage forms aux from them
exactly as one process does (`aux_loss(labels, carried)`), and the sums' gradient goes back with the hidden states'
gradient, so every stage's routers get one process's gradient. A pipeline micro-batch (parallel.chunks cuts each
micro-step) is then a micro-step of the loss, as in Megatron-LM (1F1B runs a chunk's backward before the next
chunk's forward, so no stage could wait for a whole micro-step's statistics): the pipeline's aux is that of one
process whose micro-step j holds every replica's chunk j (with one replica, train.grad_accum × chunks micro-steps).

Under sequence parallelism each rank of a tp group routes only its shard of the positions; the statistics are
summed over the tp group as over the replicas (the mixture's gradients too: gptpar.parallel.tensor_parallel.mixture).
Under context parallelism the replicas are dp x cp, each cp rank routing its shard of the rows: its real positions
are the whole rows' (a row's last label may lie in another rank's shard), found from its shard of the labels by one
small all-reduce over the cp group (`real_positions`), so every layout hands the router the labels its loss reads (a
pipeline stage its chunk of the shard, tensor parallelism's pieces the shard itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from gptpar.data.pairs import IGNORE
from gptpar.train.step_records import OnDevice

if TYPE_CHECKING:
    from gptpar.parallel.context_parallel import ContextParallel


def real_positions(labels: torch.Tensor, context: ContextParallel | None = None) -> torch.Tensor:
    """(batch, T) booleans: positions up to each row's last label the loss counts (all of them for blocks of text).
    Under `context` the labels are this rank's shard of whole rows, whose last label may lie in another rank's shard:
    the rows' last labelled global positions are the maxima over the cp group (one all-reduce of a position a row)."""
    counted = labels != IGNORE
    index = torch.arange(labels.size(1), device=labels.device) if context is None else context.global_positions(
        labels.size(1)).to(labels.device)
    last = torch.where(counted, index, -1).amax(dim=1, keepdim=True)
    if context is not None:
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=context.group)
    return index <= last


class RouterLoad:
    """Forward hooks on every router keep the router logits of a recorded forward; `aux_loss` turns them into the
    load-balancing loss over the micro-step of every replica, and counts each expert's tokens for the step record.
    Under the pipeline (`pp_group`), `carry` sums a stage's share into what the micro-batch carries, the last stage's
    `aux_loss` reads the carried sums, and `step_fields` shares the last stage's counts with every stage."""

    def __init__(self, routers: list[nn.Module], n_experts: int, top_k: int, group: dist.ProcessGroup | None,
                 replicas: int, pp_group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 sequence_shards: dist.ProcessGroup | None = None) -> None:
        self.n_experts, self.top_k, self.group, self.replicas = n_experts, top_k, group, replicas
        self.pp_group, self.device = pp_group, device
        # Sequence parallelism's tp group: each rank routes its own shard of the positions, summed over it too.
        self.sequence_shards = sequence_shards
        self._logits: dict[int, torch.Tensor] = {}  # by layer, in the order they ran
        self._recording = False
        self.layers = len(routers)
        self.tokens: torch.Tensor | float = 0.0  # the step's per layer and expert, on every replica (on the device)
        self.aux_sum: torch.Tensor | float = 0.0
        self.dropped: torch.Tensor | float = 0.0  # picks past capacity in the step, on every replica
        self.micro_steps: int | torch.Tensor = 0  # a tensor once shared over the pipeline's stages
        # The picks the listed layers' experts dropped past their capacity in their last forward
        # (gptpar.parallel.expert_parallel); None: none are ever dropped.
        self.dropped_source: Callable[[Iterable[int]], torch.Tensor] | None = None
        # Context parallelism: the labels handed in are this rank's shard of whole rows (None: whole rows).
        self.context: ContextParallel | None = None
        for index, router in enumerate(routers):
            router.register_forward_hook(partial(self._keep, index))

    def _real(self, labels: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's real positions, flat, as 0/1 in fp32: its sequence shard's under sequence or context
        parallelism."""
        real = real_positions(labels, self.context)
        if self.sequence_shards is not None:
            real = real.chunk(dist.get_world_size(self.sequence_shards), dim=1)[dist.get_rank(self.sequence_shards)]
        return real.reshape(-1).to(device, torch.float32)

    @property
    def carried_size(self) -> int:
        """The floats a pipeline micro-batch carries: picks per layer and expert, dropped picks, probability sums."""
        return self.layers * self.n_experts + 1 + self.n_experts

    def _keep(self, index: int, module: nn.Module, inputs: object, output: tuple[torch.Tensor, ...]) -> None:
        if self._recording:  # not in evaluation, decoding, or the recompute of a checkpointed block
            self._logits[index] = output[0]

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The routers' logits of the forward run inside, for one `aux_loss` (or a stage's `carry`)."""
        self._logits.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def carry(self, labels: torch.Tensor, carried: torch.Tensor | None = None) -> torch.Tensor:
        """`carried` (None: nothing yet) plus the recorded forward's statistics over the real positions of `labels`:
        (layers × experts picks, dropped picks, experts' probability sums) as one fp32 vector, the counts without
        gradient, the probability sums with their routers' (and `carried`'s)."""
        return self._carry(self._real(labels, self.device or labels.device), carried)

    def _carry(self, real: torch.Tensor, carried: torch.Tensor | None) -> torch.Tensor:
        """`carry` over the real positions `real` (flat, 0/1)."""
        picks = torch.zeros(self.layers, self.n_experts, device=real.device)
        prob_sum = torch.zeros(self.n_experts, device=real.device)
        for index, logits in self._logits.items():
            probs = torch.softmax(logits.float(), dim=-1)
            picks[index].scatter_add_(0, probs.topk(self.top_k, dim=-1).indices.reshape(-1),
                                      real.repeat_interleave(self.top_k))
            prob_sum = prob_sum + (probs * real[:, None]).sum(dim=0)
        dropped = (self.dropped_source(self._logits) if self.dropped_source is not None
                   else torch.zeros((), device=real.device))
        mine = torch.cat([picks.reshape(-1), dropped.to(real)[None], prob_sum])
        return mine if carried is None else carried + mine

    def aux_loss(self, labels: torch.Tensor, carried: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-step's load-balancing loss over every replica, as a tensor whose value is that loss and whose
        gradient is R times this replica's share of it (module docstring); from the recorded forward of every
        layer, or from what a pipeline micro-batch `carried` through every stage."""
        real = self._real(labels, carried.device if carried is not None else self.device or labels.device)
        if carried is None:
            if len(self._logits) != self.layers:
                raise RuntimeError(f"{len(self._logits)} routers ran in the recorded forward, not {self.layers}")
            carried = self._carry(real, None)
        cells = self.layers * self.n_experts
        picks, prob_sum = carried[:cells].detach().reshape(self.layers, self.n_experts), carried[cells + 1:]
        real = real.sum()
        counts = torch.cat([picks.reshape(-1), real[None], carried[cells:cells + 1].detach()]).double()
        groups = [g for g in (self.group, self.sequence_shards) if g is not None]
        if groups:
            total = prob_sum.detach().clone()
            for group in groups:
                dist.all_reduce(counts, group=group)
                dist.all_reduce(total, group=group)
            prob_sum = prob_sum + (total - prob_sum.detach())  # every replica's value, this replica's gradient
        per_layer, rows = counts[:-2].reshape(picks.shape), counts[-2] * self.layers
        self.tokens = self.tokens + per_layer
        self.dropped = self.dropped + counts[-1]
        share = per_layer.sum(dim=0).float() / rows.float()
        aux = self.n_experts * (share * prob_sum / rows.float()).sum()
        self.aux_sum = self.aux_sum + aux.detach().double()
        self.micro_steps += 1
        return aux.detach() + self.replicas * (aux - aux.detach())

    def _shared_over_stages(self) -> None:
        """Under the pipeline only the last stage formed the step's statistics: one all-reduce over the pp group
        gives every stage its sums (the others add zeros)."""
        cells = self.layers * self.n_experts
        local = torch.zeros(cells + 3, dtype=torch.float64, device=self.device)
        if self.micro_steps:
            local = torch.cat([torch.as_tensor(self.tokens).reshape(-1), torch.as_tensor(self.aux_sum).reshape(1),
                               torch.as_tensor(self.dropped).reshape(1).double(),
                               torch.tensor([float(self.micro_steps)], dtype=torch.float64, device=self.device)])
        dist.all_reduce(local, group=self.pp_group)
        self.tokens = local[:cells].reshape(self.layers, self.n_experts)
        self.aux_sum, self.dropped = local[cells], local[cells + 1]
        self.micro_steps = local[cells + 2]  # on the device: a step record reads it when it reads the rest

    def step_fields(self) -> dict[str, object]:
        """The step's `aux_loss` (mean over its micro-steps) and `moe` expert load (tokens routed per expert and
        layer over every replica: min, max and mean), then a fresh count for the next step; both read from the device
        when the step's record is (OnDevice)."""
        if self.pp_group is not None:
            self._shared_over_stages()
        elif not self.micro_steps:
            raise RuntimeError("no recorded forward ran in the step")
        tokens = torch.as_tensor(self.tokens)
        aux = torch.as_tensor(self.aux_sum) / self.micro_steps
        load = torch.stack([tokens.min(), tokens.max(), tokens.mean(), torch.as_tensor(self.dropped).to(tokens)])
        self.tokens, self.aux_sum, self.dropped, self.micro_steps = 0.0, 0.0, 0.0, 0
        return {"aux_loss": OnDevice(aux.reshape(1), lambda v: v[0]),
                "moe": OnDevice(load, lambda v: {"tokens_per_expert": dict(zip(("min", "max", "mean"), v[:3],
                                                                               strict=True)), "dropped": int(v[3])})}
