"""The Llama family cut into tensor-parallel pieces in place (`parallel.tp_impl=gptpar`), Megatron-style on nn.Linear
(weight out x in), the same plan as GPT-2's (gpt2.py) with the family's differences:

    attention: q_proj column-parallel by query heads, k_proj and v_proj by key/value heads (rank r holds query heads
               [rH/T, (r+1)H/T) and key/value heads [rK/T, (r+1)K/T): each of its query heads' group shares a key/value
               head it holds, so grouped-query attention runs locally), o_proj row-parallel;
    MLP:       gate_proj and up_proj column-parallel, down_proj row-parallel; a mixture of experts' MLP whole (its
               experts split by parallel.ep instead, over data-parallel ranks), on the whole sequence, or under
               sequence parallelism on the rank's shard (its gradients summed over the group: mixture.py);
    token table and LM head: vocabulary-parallel (tied: one Parameter; untied: the head's own rows split the same way);
    sequence parallelism: RMSNorms on sequence shards, their weights' gradients summed over the group; the rotary
               tables cover the whole sequence (`sequence_shards`), which q and k have after the all-gather;
    context parallelism: attention on this rank's heads meets the other cp ranks' sequence shards (their ring or
               all-to-all) and the rotary tables are the shard's global positions.

The block keeps the decoder layer's call (`hidden, attention_mask=None, position_embeddings=...`) so the
architecture's pipeline pieces run a sharded model as they run a whole one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from gptpar.models.build import tokenizer_vocab
from gptpar.parallel.context_parallel import active
from gptpar.parallel.tensor_parallel.comm import copy_to_tp, gather_sequence, reduce_from_tp, reduce_scatter_sequence
from gptpar.parallel.tensor_parallel.layers import (
    VocabParallelEmbedding,
    VocabParallelHead,
    group_place,
    shard,
    sharded_rng,
)


class ColumnParallelLinear(nn.Module):
    """Output features split: this rank's rows of the weight (and bias)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        rank, size = group_place(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard(linear.weight, 0, 1, rank, size)
        self.bias = shard(linear.bias, 0, 1, rank, size) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split: partial outputs summed (or reduce-scattered into sequence shards); no bias in the
    family's row-parallel layers."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        rank, size = group_place(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = shard(linear.weight, 1, 1, rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_tp(partial, self.group)


class SequenceParallelRMSNorm(nn.Module):
    """The family's RMSNorm (computed in fp32, as transformers does) on sequence shards: the same weight, its
    gradient summed over the group (`copy_to_tp` on the weight)."""

    def __init__(self, norm: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.weight, self.eps, self.group = norm.weight, norm.variance_epsilon, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.group)
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _norm(norm: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool) -> nn.Module:
    """The norm itself on whole hidden states, or its sequence-parallel counterpart."""
    return SequenceParallelRMSNorm(norm, group) if sequence_parallel else norm


class TensorParallelAttention(nn.Module):
    def __init__(self, attn: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        size = dist.get_world_size(group)
        self.q_proj, self.k_proj, self.v_proj = (ColumnParallelLinear(getattr(attn, f"{p}_proj"), group,
                                                                      sequence_parallel) for p in "qkv")
        self.o_proj = RowParallelLinear(attn.o_proj, group, sequence_parallel)
        self.head_dim, self.groups = attn.head_dim, attn.num_key_value_groups
        self.heads = attn.config.num_attention_heads // size
        self.dropout_p, self.rank = attn.attention_dropout, dist.get_rank(group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if (cp := active(self)) is not None:  # the sequence split over the cp group: its ring or all-to-all
            y = cp.attend(q, k, v, self.groups, self.head_dim ** -0.5)
        else:
            k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
            p = self.dropout_p if self.training else 0.0
            with sharded_rng(self.rank, q.device) if p else contextlib.nullcontext():  # this rank's heads: own masks
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2)
        return self.o_proj(y.reshape(b, s, self.heads * self.head_dim))


class TensorParallelMLP(nn.Module):
    def __init__(self, mlp: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(mlp.gate_proj, group, sequence_parallel)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, group, sequence_parallel)
        self.down_proj = RowParallelLinear(mlp.down_proj, group, sequence_parallel)
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TensorParallelDecoderLayer(nn.Module):
    """A decoder layer on this rank's heads and MLP columns, called as the family's own layer is."""

    def __init__(self, layer: nn.Module, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.input_layernorm = _norm(layer.input_layernorm, group, sequence_parallel)
        self.self_attn = TensorParallelAttention(layer.self_attn, group, sequence_parallel)
        self.post_attention_layernorm = _norm(layer.post_attention_layernorm, group, sequence_parallel)
        # A mixture's MLP (router, experts, shared expert) stays whole: every rank of the group runs it on the same
        # tokens, so its gradients agree over the group (parallel.ep splits its experts over data-parallel ranks).
        self.mixture = hasattr(layer.mlp, "experts")
        self.mlp = layer.mlp if self.mixture else TensorParallelMLP(layer.mlp, group, sequence_parallel)
        self.sequence_shards = dist.get_world_size(group) if sequence_parallel else 1

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **_: object) -> torch.Tensor:
        cos, sin = position_embeddings
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        normed = self.post_attention_layernorm(hidden)
        # A sequence shard may be a strided slice of the reduce-scatter's output, which a mixture's block views flat.
        return hidden + self.mlp(normed.contiguous() if self.mixture else normed)


def shard_llama(model: PreTrainedModel, group: dist.ProcessGroup, sequence_parallel: bool, loss_parallel: bool
                ) -> PreTrainedModel:
    """Replace `model`'s modules by this rank's tensor-parallel pieces, in place (see the module docstring). The
    model must be whole and equal on every rank of the group (built from the same seed)."""
    body = model.model
    tied = model.config.tie_word_embeddings
    head_weight = model.lm_head.weight
    body.embed_tokens = VocabParallelEmbedding(body.embed_tokens, group, sequence_parallel)
    for i, layer in enumerate(body.layers):
        body.layers[i] = TensorParallelDecoderLayer(layer, group, sequence_parallel)
    body.norm = _norm(body.norm, group, sequence_parallel)
    rank, size = group_place(group)
    weight = body.embed_tokens.weight if tied else shard(head_weight, 0, 1, rank, size)
    model.lm_head = VocabParallelHead(weight, tokenizer_vocab(model.config), group, sequence_parallel, loss_parallel)
    return model
