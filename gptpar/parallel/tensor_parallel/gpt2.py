"""GPT-2 cut into tensor-parallel pieces in place (`parallel.tp_impl=gptpar`), and the model that runs it.

`shard_gpt2` replaces the modules of a whole GPT2LMHeadModel by their tensor-parallel counterparts
(gptpar/parallel/tensor_parallel/layers.py) under the same names, so `transformer.h.3.attn.c_attn.weight` is still
that parameter (this rank's piece of it), checkpoints and comparisons key by GPT-2's names, and the pipeline
engine cuts the sharded model into stages exactly as it cuts a whole one:

    attention: c_attn column-parallel by heads (q, k and v each split, this rank's heads of each),
               c_proj row-parallel: one all-reduce forward, one backward (at c_attn's input);
    MLP:       c_fc column-parallel, c_proj row-parallel: the same two;
    wte / LM head: vocabulary-parallel, tied; the loss on vocabulary shards with parallel.loss_parallel;
    sequence parallelism: layer norms, dropout and residual adds on sequence shards, the all-reduces replaced
               by all-gather (before a column-parallel layer) and reduce-scatter (after a row-parallel one).

Attention runs causal scaled-dot-product attention on this rank's heads (no mask tensor), as transformers'
sdpa path does for GPT-2 without padding; under context parallelism (parallel.cp) its sequence shard meets the
other cp ranks' through their ring or all-to-all, on this rank's heads.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import GPT2LMHeadModel

from gptpar.models.build import tokenizer_vocab
from gptpar.parallel.context_parallel import active
from gptpar.parallel.tensor_parallel.layers import (
    ColumnParallelConv1D,
    Dropout,
    RowParallelConv1D,
    SequenceParallelLayerNorm,
    SequenceShardedPositions,
    VocabParallelEmbedding,
    VocabParallelHead,
    dropout,
    sharded_rng,
)


def _norm(norm: nn.LayerNorm, group: dist.ProcessGroup, sequence_parallel: bool) -> nn.Module:
    return SequenceParallelLayerNorm(norm, group) if sequence_parallel else norm


class TensorParallelAttention(nn.Module):
    def __init__(self, attn: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        size = dist.get_world_size(group)
        self.c_attn = ColumnParallelConv1D(attn.c_attn, group, sequence_parallel, parts=3)
        self.c_proj = RowParallelConv1D(attn.c_proj, group, sequence_parallel)
        self.heads, self.head_dim = attn.num_heads // size, attn.head_dim
        self.attn_p, self.resid_p = attn.attn_dropout.p, attn.resid_dropout.p
        self.rank = dist.get_rank(group)
        self.resid_rank = self.rank if sequence_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.heads * self.head_dim, dim=2)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if (cp := active(self)) is not None:  # the sequence split over the cp group: its ring or all-to-all
            y = cp.attend(q, k, v, 1, self.head_dim ** -0.5)
        else:
            p = self.attn_p if self.training else 0.0
            with sharded_rng(self.rank, q.device) if p else contextlib.nullcontext():  # this rank's heads: own masks
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2)
        y = y.reshape(b, s, self.heads * self.head_dim)
        return dropout(self.c_proj(y), self.resid_p, self.training, self.resid_rank)


class TensorParallelMLP(nn.Module):
    def __init__(self, mlp: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.c_fc = ColumnParallelConv1D(mlp.c_fc, group, sequence_parallel)
        self.c_proj = RowParallelConv1D(mlp.c_proj, group, sequence_parallel)
        self.act, self.p = mlp.act, mlp.dropout.p
        self.resid_rank = dist.get_rank(group) if sequence_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.c_proj(self.act(self.c_fc(x))), self.p, self.training, self.resid_rank)


class TensorParallelBlock(nn.Module):
    """A GPT2Block on this rank's heads and MLP columns; takes and returns hidden states only."""

    def __init__(self, block: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.ln_1 = _norm(block.ln_1, group, sequence_parallel)
        self.attn = TensorParallelAttention(block.attn, group, sequence_parallel)
        self.ln_2 = _norm(block.ln_2, group, sequence_parallel)
        self.mlp = TensorParallelMLP(block.mlp, group, sequence_parallel)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


def shard_gpt2(model: GPT2LMHeadModel, group: dist.ProcessGroup, sequence_parallel: bool, loss_parallel: bool
               ) -> GPT2LMHeadModel:
    """Replace `model`'s modules by this rank's tensor-parallel pieces, in place (see the module docstring).
    The model must be whole and equal on every rank of the group (built from the same seed)."""
    tr = model.transformer
    tr.wte = VocabParallelEmbedding(tr.wte, group, sequence_parallel)
    if sequence_parallel:
        tr.wpe = SequenceShardedPositions(tr.wpe, group)
        tr.drop = Dropout(tr.drop.p, group)
        tr.ln_f = SequenceParallelLayerNorm(tr.ln_f, group)
    for i, block in enumerate(tr.h):
        tr.h[i] = TensorParallelBlock(block, group, sequence_parallel)
    model.lm_head = VocabParallelHead(tr.wte.weight, tokenizer_vocab(model.config), group, sequence_parallel,
                                      loss_parallel)
    return model


