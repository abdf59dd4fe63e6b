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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from gptpar.data.pairs import IGNORE
from gptpar.train.step_records import OnDevice


def real_positions(labels: torch.Tensor) -> torch.Tensor:
    """(batch, T) booleans: positions up to each row's last label the loss counts (all of them for blocks of text)."""
    counted = labels != IGNORE
    index = torch.arange(labels.size(1), device=labels.device)
    last = torch.where(counted, index, -1).amax(dim=1, keepdim=True)
    return index <= last


class RouterLoad:
    """Forward hooks on every router keep the router logits of a recorded forward; `aux_loss` turns them into the
    load-balancing loss over the micro-step of every replica, and counts each expert's tokens for the step record."""

    def __init__(self, routers: list[nn.Module], n_experts: int, top_k: int, group: dist.ProcessGroup | None,
                 replicas: int) -> None:
        self.n_experts, self.top_k, self.group, self.replicas = n_experts, top_k, group, replicas
        self._logits: list[torch.Tensor] = []
        self._recording = False
        self.layers = len(routers)
        self.tokens: torch.Tensor | float = 0.0  # the step's per layer and expert, on every replica (on the device)
        self.aux_sum: torch.Tensor | float = 0.0
        self.dropped: torch.Tensor | float = 0.0  # picks past capacity in the step, on every replica
        self.micro_steps = 0
        # The picks the experts dropped past their capacity in the last forward (gptpar.parallel.expert_parallel);
        # None: none are ever dropped.
        self.dropped_source: Callable[[], torch.Tensor] | None = None
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs: object, output: tuple[torch.Tensor, ...]) -> None:
        if self._recording:  # not in evaluation, decoding, or the recompute of a checkpointed block
            self._logits.append(output[0])

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The routers' logits of the forward run inside, for one `aux_loss`."""
        self._logits.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def aux_loss(self, labels: torch.Tensor) -> torch.Tensor:
        """The micro-step's load-balancing loss over every replica, as a tensor whose value is that loss and whose
        gradient is R times this replica's share of it (module docstring)."""
        if len(self._logits) != self.layers:
            raise RuntimeError(f"{len(self._logits)} routers ran in the recorded forward, not {self.layers}")
        real = real_positions(labels).reshape(-1).to(self._logits[0].device, torch.float32)
        probs = [torch.softmax(logits.float(), dim=-1) for logits in self._logits]
        picks = torch.stack([torch.zeros(self.n_experts, device=real.device).scatter_add_(
            0, p.topk(self.top_k, dim=-1).indices.reshape(-1), real.repeat_interleave(self.top_k)) for p in probs])
        prob_sum = sum((p * real[:, None]).sum(dim=0) for p in probs)
        dropped = self.dropped_source() if self.dropped_source is not None else torch.zeros((), device=real.device)
        counts = torch.cat([picks.detach().reshape(-1), real.sum()[None], dropped.to(real)[None]]).double()
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
            total = prob_sum.detach().clone()
            dist.all_reduce(total, group=self.group)
            prob_sum = prob_sum + (total - prob_sum.detach())  # every replica's value, this replica's gradient
        per_layer, rows = counts[:-2].reshape(picks.shape), counts[-2] * len(probs)
        self.tokens = self.tokens + per_layer
        self.dropped = self.dropped + counts[-1]
        share = per_layer.sum(dim=0).float() / rows.float()
        aux = self.n_experts * (share * prob_sum / rows.float()).sum()
        self.aux_sum = self.aux_sum + aux.detach().double()
        self.micro_steps += 1
        return aux.detach() + self.replicas * (aux - aux.detach())

    def step_fields(self) -> dict[str, object]:
        """The step's `aux_loss` (mean over its micro-steps) and `moe` expert load (tokens routed per expert and
        layer over every replica: min, max and mean), then a fresh count for the next step; both read from the device
        when the step's record is (OnDevice)."""
        if not self.micro_steps:
            raise RuntimeError("no recorded forward ran in the step")
        tokens = torch.as_tensor(self.tokens)
        aux = torch.as_tensor(self.aux_sum) / self.micro_steps
        load = torch.stack([tokens.min(), tokens.max(), tokens.mean(), torch.as_tensor(self.dropped).to(tokens)])
        self.tokens, self.aux_sum, self.dropped, self.micro_steps = 0.0, 0.0, 0.0, 0
        return {"aux_loss": OnDevice(aux.reshape(1), lambda v: v[0]),
                "moe": OnDevice(load, lambda v: {"tokens_per_expert": dict(zip(("min", "max", "mean"), v[:3],
                                                                               strict=True)), "dropped": int(v[3])})}
