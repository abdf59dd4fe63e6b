"""GPT-2 (transformers' GPT2LMHeadModel): learned positions, LayerNorm, fused q/k/v in Conv1D layers, a 4x GELU
MLP, the head tied to the token table. Its tensor-parallel conversions live in gptpar/parallel/tensor_parallel
(gpt2.py: ours on Conv1D; torch_plan.py: torch's DTensor plan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from gptpar.models.base import Architecture, position_ids
from gptpar.presets import ModelShape

# Attention implementations that apply the causal mask themselves when given no mask.
_IMPLICIT_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3")


def implicit_causal(model: nn.Module) -> bool:
    """Whether the model's attention masks the future itself, so a block is passed no mask."""
    return model.config._attn_implementation in _IMPLICIT_CAUSAL


def causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """Additive (1, 1, T, T) mask hiding future positions, for attention that needs it explicit."""
    t = hidden.size(1)
    future = torch.ones(t, t, dtype=torch.bool, device=hidden.device).triu(1)
    mask = torch.zeros(t, t, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(future, torch.finfo(hidden.dtype).min)[None, None]


class Embedding(nn.Module):
    """Token plus position embeddings, then dropout, as GPT2Model does it."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = position_ids(self.wpe, input_ids.size(1), input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class Block(nn.Module):
    """A GPT2Block that carries hidden states only, whatever the transformers version returns."""

    def __init__(self, block: nn.Module, implicit_causal: bool) -> None:
        super().__init__()
        self.block, self.implicit_causal = block, implicit_causal

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = None if self.implicit_causal else causal_mask(hidden)
        out = self.block(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Final norm and LM head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, norm_name: str = "ln_f") -> None:
        super().__init__()
        self.norm_name = norm_name
        self.add_module(norm_name, norm)
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(getattr(self, self.norm_name)(hidden))


def gpt2_config(shape: ModelShape, vocab_size: int, dropout: float) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size, n_positions=shape.n_positions, n_embd=shape.n_embd, n_layer=shape.n_layer,
        n_head=shape.n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        use_cache=False, tie_word_embeddings=True, bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1, attn_implementation="sdpa",
    )


@dataclass(frozen=True)
class GPT2Architecture(Architecture):
    def embed_piece(self, model: nn.Module) -> nn.Module:
        tr = model.transformer
        return Embedding(tr.wte, tr.wpe, tr.drop)

    def block_piece(self, model: nn.Module, index: int) -> nn.Module:
        return Block(model.transformer.h[index], implicit_causal(model))

    def head_piece(self, model: nn.Module) -> nn.Module:
        return Head(model.transformer.ln_f, model.lm_head)


# GPT2PreTrainedModel._init_weights, by parameter name.
GPT2 = GPT2Architecture(
    name="gpt2", title="GPT-2", model_class=GPT2LMHeadModel, body="transformer", embedding="wte", layers="h",
    final_norm="ln_f",
    top_level_init={"transformer.wte.weight": "normal", "transformer.wpe.weight": "normal",
                    "transformer.ln_f.weight": "ones", "transformer.ln_f.bias": "zeros", "lm_head.weight": "normal"},
    in_block_init={"ln_1.weight": "ones", "ln_1.bias": "zeros", "ln_2.weight": "ones", "ln_2.bias": "zeros",
                   "attn.c_attn.weight": "normal", "attn.c_attn.bias": "zeros",
                   "attn.c_proj.weight": "residual", "attn.c_proj.bias": "zeros",
                   "mlp.c_fc.weight": "normal", "mlp.c_fc.bias": "zeros",
                   "mlp.c_proj.weight": "residual", "mlp.c_proj.bias": "zeros"},
    config_of=gpt2_config,
    dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop"),
)
