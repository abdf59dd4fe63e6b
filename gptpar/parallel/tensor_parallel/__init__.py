"""Tensor parallelism (`parallel.tp`): each layer's matrices split over the grid's `tp` group.

Two implementations of one plan (gpt2.py's docstring): ours (`gptpar`, layers.py and gpt2.py, with our own
autograd collectives in comm.py and the vocabulary-parallel loss in loss.py) and PyTorch's (`torch`,
torch_plan.py, on DTensor). Both convert a whole GPT2LMHeadModel in place and run through the same forward
(`tensor_parallel_forward`), so the trainer, the pipeline engine and the data-parallel syncs take a sharded
model as they take a whole one. state.py says how pieces are rebuilt, checkpointed and counted in norms.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers import GPT2LMHeadModel

from gptpar.config import ParallelConfig
from gptpar.model import lm_loss
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.tensor_parallel.comm import gather_last_dim
from gptpar.parallel.tensor_parallel.gpt2 import TensorParallelGPT2, shard_gpt2, tensor_parallel_forward
from gptpar.parallel.tensor_parallel.loss import vocab_parallel_loss
from gptpar.parallel.tensor_parallel.torch_plan import loss_context as torch_loss_context
from gptpar.parallel.tensor_parallel.torch_plan import parallelize_gpt2, torch_lm_loss

__all__ = ["TensorParallelGPT2", "loss_context", "loss_function", "shard_model", "tensor_parallel_forward",
           "whole_logits"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shard_model(model: GPT2LMHeadModel, pcfg: ParallelConfig, dims: ParallelDims, device: torch.device
                ) -> GPT2LMHeadModel:
    """`model` (whole, the same on every rank) moved to `device` and cut into this rank's tensor-parallel pieces
    by parallel.tp_impl, in place."""
    model.to(device)
    if pcfg.tp_impl == "torch":
        return parallelize_gpt2(model, dims.mesh["tp"], pcfg.sequence_parallel, pcfg.loss_parallel)
    return shard_gpt2(model, dims.group("tp"), pcfg.sequence_parallel, pcfg.loss_parallel)


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
