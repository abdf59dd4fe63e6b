"""The backward pass split in two for zero-bubble schedules: B computes input gradients, W weight gradients.

A stage's B pass must send its input gradient to the previous stage as soon as possible; the weight
gradients are needed only by the optimizer step, so ZB-H1 computes them later, in time the stage would
otherwise wait. The matrix multiplications are where the weight gradients cost (one matmul each,
as large as the input-gradient one), so every projection of a stage (GPT-2's `Conv1D` layers and the
LM head) runs through `_DeferrableMatmul`: while a `WeightGradStore` is deferring, its backward returns
only the input gradient and files (input, output gradient) with the store; `apply` later turns each
filed pair into the weight and bias gradients, accumulated into `.grad` as autograd would have. Under autocast the
pair is kept in the dtype the forward's matmul ran in, so W computes in that dtype too and casts the result to the
parameter's, as autograd does with an autocast layer's weight gradient.
Layer norms and embeddings are small and keep their gradients in B. Outside deferral the layer
computes all gradients at once, so the same module serves every schedule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D


class WeightGradStore:
    """Collects the (layer, input, output gradient) triples of one B pass while deferring."""

    def __init__(self) -> None:
        self.deferring = False
        self.filed: list[tuple[DeferrableLinear, torch.Tensor, torch.Tensor]] = []

    def take(self) -> list[tuple[DeferrableLinear, torch.Tensor, torch.Tensor]]:
        filed, self.filed = self.filed, []
        return filed


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add into .grad in place (it may be a view of a gradient bucket), as autograd accumulates."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


@torch.no_grad()
def apply_weight_grads(filed: list[tuple[DeferrableLinear, torch.Tensor, torch.Tensor]]) -> None:
    """The W pass: each filed layer's weight (and bias) gradient from its input and output gradient. Outside
    autograd's backward, so without grad mode: the saved input still requires grad, and a gradient that recorded
    its history would keep the micro-batch's graph alive until the next zero_grad."""
    for layer, x, grad_out in filed:
        weight_grad, bias_grad = layer.weight_grads(x, grad_out)
        _accumulate(layer.weight, weight_grad)
        if layer.bias is not None:
            _accumulate(layer.bias, bias_grad)


class _DeferrableMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: DeferrableLinear) -> torch.Tensor:
        # F.linear, as the layer it replaces: under autocast it runs in the autocast dtype, bias included; the input
        # is saved as the matmul saw it, so the backward's matmuls run in the forward's dtype.
        out = F.linear(x, layer.as_out_in(weight), bias)
        ctx.save_for_backward(x.to(out.dtype), weight)
        ctx.layer, ctx.input_dtype = layer, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        layer: DeferrableLinear = ctx.layer
        grad_out = grad_out.to(x.dtype)
        grad_x = (grad_out @ layer.as_out_in(weight).to(x.dtype)).to(ctx.input_dtype)
        x2d, g2d = x.reshape(-1, x.size(-1)), grad_out.reshape(-1, grad_out.size(-1))
        if layer.store.deferring:
            layer.store.filed.append((layer, x2d, g2d))
            return grad_x, None, None, None
        weight_grad, bias_grad = layer.weight_grads(x2d, g2d)
        return grad_x, weight_grad, bias_grad, None


class DeferrableLinear(nn.Module):
    """A Conv1D (weight in x out) or nn.Linear (weight out x in) whose weight gradient can be deferred.
    It keeps the original Parameters under the same names, so checkpoints and optimizers are unchanged."""

    def __init__(self, layer: nn.Module, store: WeightGradStore) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.in_out = isinstance(layer, Conv1D)
        self.store = store

    def as_out_in(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as nn.Linear holds it (out x in)."""
        return weight.t() if self.in_out else weight

    def weight_grads(self, x2d: torch.Tensor, g2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In the dtype the forward's matmul ran in (x2d's and g2d's), returned in the parameters' dtype, as autograd
        casts an autocast matmul's weight gradient back to its fp32 weight."""
        weight_grad = (x2d.t() @ g2d if self.in_out else g2d.t() @ x2d).to(self.weight.dtype)
        return weight_grad, g2d.sum(0).to(self.bias.dtype) if self.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferrableMatmul.apply(x, self.weight, self.bias, self)


def make_deferrable(module: nn.Module, store: WeightGradStore) -> int:
    """Replace every Conv1D and nn.Linear inside `module` by a DeferrableLinear; returns how many."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (Conv1D, nn.Linear)):
                setattr(parent, name, DeferrableLinear(child, store))
                replaced += 1
    return replaced
