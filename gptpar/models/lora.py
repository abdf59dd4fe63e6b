"""LoRA (train.lora_rank > 0) through peft: low-rank adapters beside the adapted layers, which alone train.

peft's `inject_adapter_in_model` rewrites the model in place, so it stays the transformers model every reader finds
(`find_model`, `architecture`): an adapted layer becomes peft's LoRA layer holding the original as `base_layer` and
the adapters as `lora_A.default` (r x in) and `lora_B.default` (out x r); every other parameter is frozen. Its
output is base(x) + (alpha / r) * B(A(dropout(x))).

Names are what ties values to parameters in gptpar (gptpar.models.build draws each parameter's initial value from the
run seed and its name): a `base_layer` weight is the layer's own (its name without `.base_layer`), B starts at
zeros (the adapted model starts as the base model) and A as peft draws it, uniform in +-1/sqrt(in) (kaiming's with
a = sqrt(5)), but from a generator seeded by the run seed and A's name: the same on every rank, device and build
(meta included), where peft draws from the process's generator.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from gptpar.adapters import lora_targets, matches
from gptpar.architectures import ARCHITECTURES
from gptpar.config import TrainConfig
from gptpar.errors import GptparError, first_sentence
from gptpar.models import architecture

if TYPE_CHECKING:  # peft itself is imported where a run has LoRA: its import costs seconds that other runs never pay
    from peft import LoraConfig

ADAPTER = "default"  # peft's adapter name, part of every adapter parameter's name
_ADAPTER_WEIGHT = re.compile(rf"\.lora_([AB])\.{ADAPTER}\.weight$")
ADAPTABLE = (nn.Linear, Conv1D, nn.Embedding)  # the layer kinds whose names the error for a bad target lists


def base_name(name: str) -> str:
    """The name a parameter of an adapted layer had before peft wrapped the layer."""
    return name.replace(".base_layer.", ".")


def adapter_part(name: str) -> str | None:
    """"A" or "B" for an adapter's parameter, None for the model's own."""
    match = _ADAPTER_WEIGHT.search(name)
    return match[1] if match else None


def adapter_value(part: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """An adapter's initial value (float32, CPU): B zeros, A uniform in +-1/sqrt(in), drawn from `generator`."""
    if part == "B":
        return torch.zeros(shape, dtype=torch.float32)
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def check_targets(model: PreTrainedModel, targets: list[str]) -> None:
    """Every target names a module of the model: one line listing the adaptable layers' names where one does not."""
    names = [name for name, _ in model.named_modules()]
    for target in targets:
        if not any(matches(name, target) for name in names):
            layers = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, ADAPTABLE)})
            raise GptparError(f"train.lora_targets: {target!r} matches no module of this "
                              f"{architecture(model).title}; its layers are named {', '.join(layers)} (a dotted "
                              "tail such as attn.c_proj picks one of a name's kinds)")


def inject_lora(model: PreTrainedModel, t: TrainConfig) -> None:
    """Adapters on train.lora_targets in place, every other parameter frozen but the architecture's `lora_trained`
    modules (ViT's classifier, new for its classes). On a meta-device model they are made on
    the meta device too; elsewhere their values are peft's until gptpar.models.build.add_lora sets them. The process's
    random generator is left as it was (peft draws A from it)."""
    from peft import inject_adapter_in_model

    targets = lora_targets(model.config.model_type, t.lora_targets)
    check_targets(model, targets)
    meta = any(p.is_meta for p in model.parameters())
    config = lora_config(model, t)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns of what it adjusts (fan_in_fan_out); gptpar sets it
        try:
            inject_adapter_in_model(config, model, low_cpu_mem_usage=meta)
        except (ValueError, TypeError) as exc:  # a target peft cannot adapt (a block, a norm)
            raise GptparError(f"train.lora_targets={','.join(targets)}: peft cannot adapt them "
                              f"({first_sentence(exc)}); name linear layers") from None
    for name in ARCHITECTURES[model.config.model_type].lora_trained:  # a classifier's new head trains whole
        model.get_submodule(name).requires_grad_(True)


def lora_config(model: PreTrainedModel, t: TrainConfig) -> LoraConfig:
    """peft's config of train.lora_* for `model` (the adapters' file records it beside them)."""
    from peft import LoraConfig

    targets = lora_targets(model.config.model_type, t.lora_targets)
    return LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout, target_modules=targets,
                      fan_in_fan_out=_conv1d_targets(model, targets))


def adapter_config(model: PreTrainedModel, t: TrainConfig) -> LoraConfig:
    """lora_config for the adapter folder that export writes: the architecture's `lora_trained` modules (ViT's
    classifier) as peft's modules_to_save, so the folder carries their trained weights and peft puts them back
    where it loads them. Training injects without them: peft would train a copy of each under new names
    (`modules_to_save.default`), where gptpar keeps every parameter under its model's own name."""
    config = lora_config(model, t)
    config.modules_to_save = list(ARCHITECTURES[model.config.model_type].lora_trained) or None
    return config


def _conv1d_targets(model: nn.Module, targets: list[str]) -> bool:
    """Whether the targets are GPT-2's Conv1D layers, whose weights peft must read transposed (fan_in_fan_out)."""
    return any(isinstance(m, Conv1D) for name, m in model.named_modules()
               if any(matches(name, target) for target in targets))


def trainable_count(model: nn.Module) -> int:
    """Parameters that train (whole, where a sync shards them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
