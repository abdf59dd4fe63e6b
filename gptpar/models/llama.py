"""The Llama family (transformers' LlamaForCausalLM, Qwen2ForCausalLM): rotary positions, RMSNorm, grouped-query
attention (q_proj over n_head heads, k_proj and v_proj over n_kv_head), a gated SiLU MLP (gate_proj, up_proj,
down_proj), the head tied or not. Llama has no biases; Qwen2 has them on q, k and v. Another decoder of this
shape (Mistral without its sliding window, for one) is one more `LlamaFamily` entry here and its row in the
registry (gptpar/architectures.py).

Every parameter starts as the family's `_init_weights` draws it: N(0, initializer_range) for linear and embedding
weights, zeros for biases, ones for the norms. The rotary tables are buffers computed from the config, re-made
wherever the model is materialised; each pipeline block computes its cos/sin from the block's own positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, Qwen2Config, Qwen2ForCausalLM

from gptpar.models.base import Architecture, position_ids
from gptpar.models.gpt2 import Head
from gptpar.presets import ModelShape

ROTARY = "rotary_emb"


class TokenEmbedding(nn.Module):
    """Token ids to embeddings (the family adds no positions and no dropout here)."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


def rotary_tables(rotary: nn.Module, hidden: torch.Tensor, shards: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the T positions of `hidden` (batch, T / shards, width): a sequence-parallel layer sees one of
    `shards` pieces of the sequence and attends over all of it, as the decoder body computes them (positions
    0..T-1, or a context-parallel shard's: `position_ids`)."""
    positions = position_ids(rotary, hidden.size(1) * shards, hidden.device)[None]
    return rotary(hidden, positions)


class RotaryBlock(nn.Module):
    """A decoder layer that takes and returns hidden states only: it computes its rotary tables itself (for the whole
    sequence when the layer is sequence-parallel: its `sequence_shards`), and passes no mask (sdpa masks the future
    itself), as the body does for a batch without padding."""

    def __init__(self, block: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.block, self.rotary = block, rotary  # the rotary module has no parameters, only its buffers

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tables = rotary_tables(self.rotary, hidden, getattr(self.block, "sequence_shards", 1))
        return self.block(hidden, attention_mask=None, position_embeddings=tables)


def common_config(shape: ModelShape, vocab_size: int, dropout: float) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=shape.n_embd, intermediate_size=shape.mlp_width,
                num_hidden_layers=shape.n_layer, num_attention_heads=shape.n_head, num_key_value_heads=shape.kv_heads,
                max_position_embeddings=shape.n_positions, rope_theta=shape.rope_theta, attention_dropout=dropout,
                tie_word_embeddings=shape.tied, use_cache=False, bos_token_id=vocab_size - 1,
                eos_token_id=vocab_size - 1, attn_implementation="sdpa")


def llama_config(shape: ModelShape, vocab_size: int, dropout: float) -> PretrainedConfig:
    return LlamaConfig(**common_config(shape, vocab_size, dropout), rms_norm_eps=1e-5, attention_bias=False,
                       mlp_bias=False)


def qwen2_config(shape: ModelShape, vocab_size: int, dropout: float) -> PretrainedConfig:
    return Qwen2Config(**common_config(shape, vocab_size, dropout), rms_norm_eps=1e-6, use_sliding_window=False)


@dataclass(frozen=True)
class LlamaFamily(Architecture):
    def restore_buffers(self, model: nn.Module, device: torch.device) -> None:
        """The rotary tables, which `to_empty` leaves uninitialised: a fresh module's, on `device`."""
        decoder = self.decoder(model)
        rotary = getattr(decoder, ROTARY)
        setattr(decoder, ROTARY, type(rotary)(config=model.config).to(device))

    def embed_piece(self, model: nn.Module) -> nn.Module:
        return TokenEmbedding(self.token_embedding(model))

    def block_piece(self, model: nn.Module, index: int) -> nn.Module:
        return RotaryBlock(self.blocks(model)[index], getattr(self.decoder(model), ROTARY))

    def head_piece(self, model: nn.Module) -> nn.Module:
        return Head(self.decoder(model).norm, model.lm_head, "norm")


def family(name: str, title: str, model_class: type, config_of, biases: bool,
           mlp: dict[str, str] | None = None, router: str = "") -> LlamaFamily:
    """A Llama-family decoder; `mlp` names its MLP's parameters inside a block and how they start (the gated MLP's
    by default), `router` a mixture's router inside a block."""
    in_block = {f"self_attn.{p}_proj.weight": "normal" for p in "qkvo"}
    in_block |= mlp if mlp is not None else {f"mlp.{p}_proj.weight": "normal" for p in ("gate", "up", "down")}
    in_block |= {"input_layernorm.weight": "ones", "post_attention_layernorm.weight": "ones"}
    if biases:
        in_block |= {f"self_attn.{p}_proj.bias": "zeros" for p in "qkv"}
    return LlamaFamily(
        name=name, title=title, model_class=model_class, body="model", embedding="embed_tokens", layers="layers",
        final_norm="norm",
        top_level_init={"model.embed_tokens.weight": "normal", "model.norm.weight": "ones", "lm_head.weight": "normal"},
        in_block_init=in_block, config_of=config_of, restored_buffers=f"model.{ROTARY}",
        dropout_keys=("attention_dropout",), router=router)


LLAMA = family("llama", "Llama", LlamaForCausalLM, llama_config, biases=False)
QWEN2 = family("qwen2", "Qwen2", Qwen2ForCausalLM, qwen2_config, biases=True)
