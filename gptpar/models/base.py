"""What gptpar needs to know of an architecture, as one class whose instances describe GPT-2 and the Llama family
(gpt2.py, llama.py), and ViT (vit.py: an image classifier; its `body` is the encoder, its `embedding` the patches').
Module paths are data (`body`, `embedding`, `layers`, `final_norm`); how a parameter starts and the pipeline's pieces
are methods (the tensor-parallel plans are parallel/tensor_parallel's)."""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from gptpar.architectures import ARCHITECTURES
from gptpar.errors import GptparError
from gptpar.presets import ModelShape


def packed_examples(positions: torch.Tensor) -> torch.Tensor:
    """(batch, T): each position's example in its packed row (data.packing), a new one starting where the position id
    is 0."""
    return (positions == 0).cumsum(dim=1)


def packed_attention(positions: torch.Tensor) -> torch.Tensor:
    """The (batch, 1, T, T) boolean mask of packed rows (data.packing): causal within each example (a new one starts
    where the position id is 0), nothing across them. transformers takes a 4-d mask as it is, in every family."""
    example = packed_examples(positions)
    same = example[:, :, None] == example[:, None, :]
    causal = torch.ones(positions.size(1), positions.size(1), dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]


def position_ids(module: nn.Module, length: int, device: torch.device) -> torch.Tensor:
    """The position ids of the `length` tokens `module` runs (a pipeline piece's position table or rotary module):
    0..length - 1, or the global positions of this rank's shard where context parallelism attached itself to the
    model's modules as `context_parallel` (gptpar.parallel.context_parallel), which the pieces never see as a batch."""
    split = getattr(module, "context_parallel", None)
    return split.positions(length, device) if split is not None else torch.arange(length, device=device)


def find_model(module: nn.Module) -> PreTrainedModel:
    """The transformers model inside whatever wraps it (a pipeline's one-process wrapper, FSDP, DDP)."""
    found = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    if found is None:
        raise GptparError(f"no transformers model inside {type(module).__name__}")
    return found


@dataclass(frozen=True)
class Architecture(ABC):
    """One decoder family. Names are attribute paths inside transformers' `<Family>ForCausalLM`: the decoder body
    (`body`), its token table, block list and final norm; the LM head is `lm_head` in every family."""

    name: str  # transformers' config.model_type, and model.arch
    title: str  # as messages name it
    model_class: type[PreTrainedModel]
    body: str
    embedding: str
    layers: str
    final_norm: str
    top_level_init: dict[str, str]  # full parameter name -> init kind
    in_block_init: dict[str, str]  # name inside a block -> init kind
    config_of: Callable[[ModelShape, int, float], PretrainedConfig] = field(repr=False)
    restored_buffers: str = ""  # the module whose buffers `restore_buffers` re-creates (the rotary tables)
    dropout_keys: tuple[str, ...] = ()  # the config's dropout rates, which model.dropout sets on loaded weights too
    router: str = ""  # a mixture of experts: its router's path inside a block ("": a dense model)

    @property
    def classifier(self) -> bool:
        """An image classifier (the registry's kind): no token table to pad or tie, no LM head."""
        return ARCHITECTURES[self.name].classifier

    # --- where things are ---------------------------------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        return getattr(model, self.body)

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.decoder(model), self.layers)

    def token_embedding(self, model: nn.Module) -> nn.Module:
        return getattr(self.decoder(model), self.embedding)

    def routers(self, model: nn.Module) -> list[nn.Module]:
        """A mixture's router of every block, in order (none for a dense model)."""
        return [block.get_submodule(self.router) for block in self.blocks(model)] if self.router else []

    @property
    def token_table(self) -> str:
        """The token table's parameter name (the tied head's too)."""
        return f"{self.body}.{self.embedding}.weight"

    @property
    def block_prefix(self) -> str:
        return f"{self.body}.{self.layers}"

    # --- how parameters start -----------------------------------------------------------------------------------
    def init_kind(self, name: str, n_layer: int) -> str:
        """How parameter `name` starts: "normal" is N(0, initializer_range), "residual" that over sqrt(2 * n_layer)
        (GPT-2's projections into the residual stream), "zeros" and "ones" constants."""
        if name in self.top_level_init:
            return self.top_level_init[name]
        match = re.fullmatch(rf"{re.escape(self.block_prefix)}\.(\d+)\.(.+)", name)
        if match and int(match[1]) < n_layer and match[2] in self.in_block_init:
            return self.in_block_init[match[2]]
        raise GptparError(f"no initial value is defined for a {self.name} parameter named {name!r} "
                          f"(n_layer={n_layer}); add it to its table in gptpar/models")

    def init_std(self, kind: str, config: PretrainedConfig) -> float:
        std = config.initializer_range
        return std / math.sqrt(2 * config.num_hidden_layers) if kind == "residual" else std

    def restore_buffers(self, model: nn.Module, device: torch.device) -> None:  # noqa: B027 - a no-op by default
        """Re-create the buffers `to_empty` left uninitialised (none by default)."""

    # --- the pipeline's pieces ----------------------------------------------------------------------------------
    @abstractmethod
    def embed_piece(self, model: nn.Module) -> nn.Module:
        """Token ids to the first block's input."""

    @abstractmethod
    def block_piece(self, model: nn.Module, index: int) -> nn.Module:
        """Block `index` taking and returning hidden states only; its parameters are the block's as `block.<name>`."""

    @abstractmethod
    def head_piece(self, model: nn.Module) -> nn.Module:
        """The final norm and the LM head: hidden states to logits."""
