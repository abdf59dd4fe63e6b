"""Tensor parallelism (`parallel.tp`): each layer's matrices split over the grid's `tp` group.

Two implementations of one plan per architecture family (gpt2.py's and llama.py's docstrings; the registry,
gptpar/architectures.py, names each architecture's): ours (`gptpar`, layers.py, gpt2.py and llama.py, with our own
autograd collectives in comm.py and the vocabulary-parallel loss in loss.py) and PyTorch's (`torch`, torch_plan.py,
on DTensor). Both convert a whole model in place, keeping the architecture's pieces callable as before, so a sharded
model runs through the same pieces (`TensorParallelModel`, the pipeline engine's stages) and the data-parallel syncs
take it as they take a whole one. state.py says how pieces are rebuilt, checkpointed and counted in norms.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from importlib import import_module
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from gptpar.architectures import ARCHITECTURES
from gptpar.config import ParallelConfig
from gptpar.models import architecture
from gptpar.models.loss import lm_loss
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.tensor_parallel.comm import gather_last_dim
from gptpar.parallel.tensor_parallel.loss import vocab_parallel_loss
from gptpar.parallel.tensor_parallel.torch_plan import loss_context as torch_loss_context
from gptpar.parallel.tensor_parallel.torch_plan import torch_lm_loss

__all__ = ["TensorParallelModel", "loss_context", "loss_function", "shard_model", "tensor_parallel_forward",
           "whole_logits"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shard_model(model: PreTrainedModel, pcfg: ParallelConfig, dims: ParallelDims, device: torch.device
                ) -> PreTrainedModel:
    """`model` (whole, the same on every rank) moved to `device` and cut into this rank's tensor-parallel pieces
    by parallel.tp_impl and its family's plan, in place: the registry's (gptpar/architectures.py) `tp_shard` or
    `torch_tp_shard`, a function (model, the tp group or mesh, sequence_parallel, loss_parallel) -> model."""
    model.to(device)
    row = ARCHITECTURES[architecture(model).name]
    if pcfg.tp_impl == "torch":
        return _sharding(row.torch_tp_shard)(model, dims.mesh["tp"], pcfg.sequence_parallel, pcfg.loss_parallel)
    return _sharding(row.tp_shard)(model, dims.group("tp"), pcfg.sequence_parallel, pcfg.loss_parallel)


def _sharding(ref: str) -> Callable[..., PreTrainedModel]:
    """A sharding function named by its "module:function" string."""
    module, _, function = ref.partition(":")
    return getattr(import_module(module), function)


def _pieces(model: PreTrainedModel) -> nn.Sequential:
    """The architecture's pieces of a (sharded) model, in the order they run: embedding, blocks, head."""
    arch = architecture(model)
    return nn.Sequential(arch.embed_piece(model), *(arch.block_piece(model, i) for i in range(len(arch.blocks(model)))),
                         arch.head_piece(model))


def tensor_parallel_forward(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a sharded model through its architecture's pieces (embedding, blocks, final norm and head); with
    sequence parallelism the hidden states between them are this rank's sequence shard."""
    return _pieces(model)(input_ids)


class TensorParallelModel(nn.Module):
    """`forward(input_ids) -> logits` of this rank's pieces (the trainer's model when parallel.tp > 1 and pp = 1).
    Parameters are named `model.<the model's name>`, as ParallelGPT2 names them."""

    def __init__(self, model: PreTrainedModel, device: torch.device):
        super().__init__()
        self.model = model.to(device)
        self.input_device = self.output_device = device
        self.stage_devices = [device]
        self.bubble = None
        self.__dict__["pieces"] = _pieces(model)  # they wrap the model's own modules: kept out of the tree

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.pieces(input_ids)


def loss_function(pcfg: ParallelConfig, dims: ParallelDims, vocab: int, whole: Loss = lm_loss) -> Loss:
    """The language-model loss of what the model returns: `whole` of whole logits, or the loss of vocabulary shards
    (loss_parallel)."""
    if dims.size("tp") == 1 or not pcfg.loss_parallel:
        return whole
    if pcfg.tp_impl == "torch":
        return torch_lm_loss
    return functools.partial(vocab_parallel_loss, vocab=vocab, group=dims.group("tp"))


def whole_logits(pcfg: ParallelConfig, dims: ParallelDims, vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """What turns the model's output into the whole logits that greedy decoding reads: loss parallelism leaves each
    rank its vocabulary columns (a DTensor under tp_impl=torch), gathered here over the tp group (a collective)."""
    if dims.size("tp") == 1 or not pcfg.loss_parallel:
        return lambda logits: logits
    if pcfg.tp_impl == "torch":
        return lambda logits: logits.full_tensor()[..., :vocab]
    group = dims.group("tp")
    return lambda logits: gather_last_dim(logits, group)[..., :vocab]


def loss_context(pcfg: ParallelConfig, dims: ParallelDims) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What must enclose the loss and its backward: torch's loss_parallel() for its sharded logits, else nothing."""
    return functools.partial(torch_loss_context, dims.size("tp") > 1 and pcfg.loss_parallel and pcfg.tp_impl == "torch")
