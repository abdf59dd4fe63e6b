"""Each architecture described once (torchtitan's models/<name>/): how to build it, where its embedding, blocks, final
norm and head are, how each parameter starts and the pieces a pipeline cuts it into. The parallel code and the
trainer read an `Architecture` and never name one (tensor parallelism keeps one plan per family, chosen by its
name); adding a decoder of the same shape is a table entry in llama.py, a new family one file.

`architecture(model_or_config)` finds the description from transformers' `config.model_type`.
"""

from __future__ import annotations

from gptpar.errors import GptparError
from gptpar.models.base import Architecture, find_model, packed_attention
from gptpar.models.gpt2 import GPT2
from gptpar.models.llama import LLAMA, QWEN2
from gptpar.models.moe import MIXTRAL, QWEN2_MOE

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (GPT2, LLAMA, QWEN2, MIXTRAL, QWEN2_MOE)}


def architecture(of: object) -> Architecture:
    """The description of a transformers model, its config, or an architecture's name."""
    name = of if isinstance(of, str) else getattr(getattr(of, "config", of), "model_type", None)
    if name not in ARCHITECTURES:
        raise GptparError(f"gptpar has no description of the architecture {name!r}; it knows "
                          f"{', '.join(ARCHITECTURES)} (gptpar/models)")
    return ARCHITECTURES[name]


__all__ = ["ARCHITECTURES", "Architecture", "architecture", "find_model", "packed_attention"]
