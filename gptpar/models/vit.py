"""ViT (transformers' ViTForImageClassification): an image cut into patches, each projected to a token, a class
token and learned positions in front, pre-norm blocks of GPT-2's shape (biased q/k/v/o, a 4x GELU MLP), a final
LayerNorm and a linear classifier over the class token. It trains under data parallelism only: the config refuses
tensor, pipeline and expert parallelism for it (gptpar.config.checks), so it has no pipeline pieces."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import ViTConfig, ViTForImageClassification

from gptpar.errors import GptparError
from gptpar.models.base import Architecture
from gptpar.presets import ModelShape


def vit_config(shape: ModelShape, classes: int, dropout: float) -> ViTConfig:
    """The transformers config of a ViT shape over `classes` classes."""
    return ViTConfig(hidden_size=shape.n_embd, num_hidden_layers=shape.n_layer, num_attention_heads=shape.n_head,
                     intermediate_size=shape.mlp_width, image_size=shape.image_size, patch_size=shape.patch_size,
                     num_labels=classes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     attn_implementation="sdpa")


@dataclass(frozen=True)
class ViTArchitecture(Architecture):
    def _whole_only(self, piece: str) -> GptparError:
        return GptparError(f"{self.title} has no {piece} piece: it runs whole (parallel.pp=1, parallel.tp=1)")

    def embed_piece(self, model: nn.Module) -> nn.Module:
        raise self._whole_only("embedding")

    def block_piece(self, model: nn.Module, index: int) -> nn.Module:
        raise self._whole_only("block")

    def head_piece(self, model: nn.Module) -> nn.Module:
        raise self._whole_only("head")


# ViTPreTrainedModel._init_weights, by parameter name: linear and convolution weights N(0, initializer_range), biases
# zero, LayerNorm ones and zeros; the class token and positions truncated normal at +-2, which at std 0.02 is normal.
VIT = ViTArchitecture(
    name="vit", title="ViT", model_class=ViTForImageClassification, body="vit", embedding="embeddings",
    layers="layers", final_norm="layernorm",
    top_level_init={"vit.embeddings.cls_token": "normal", "vit.embeddings.position_embeddings": "normal",
                    "vit.embeddings.patch_embeddings.projection.weight": "normal",
                    "vit.embeddings.patch_embeddings.projection.bias": "zeros",
                    "vit.layernorm.weight": "ones", "vit.layernorm.bias": "zeros",
                    "classifier.weight": "normal", "classifier.bias": "zeros"},
    in_block_init={**{f"attention.{p}_proj.{kind}": init for p in "qkvo"
                      for kind, init in (("weight", "normal"), ("bias", "zeros"))},
                   "layernorm_before.weight": "ones", "layernorm_before.bias": "zeros",
                   "layernorm_after.weight": "ones", "layernorm_after.bias": "zeros",
                   "mlp.fc1.weight": "normal", "mlp.fc1.bias": "zeros",
                   "mlp.fc2.weight": "normal", "mlp.fc2.bias": "zeros"},
    config_of=vit_config,
    dropout_keys=("hidden_dropout_prob", "attention_probs_dropout_prob"),
)
