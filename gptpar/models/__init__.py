"""Each architecture described once (torchtitan's models/<name>/): how to build it, where its embedding, blocks, final
norm and head are, how each parameter starts and the pieces a pipeline cuts it into. The parallel code and the
trainer read an `Architecture` and never name one. Which architectures there are, and which description serves each,
is the registry's (gptpar/architectures.py): a decoder of an existing family is a row there and a description beside
its family's (llama.py), a new family a row and one file here.

The model home: build.py makes the model of a config (random or pretrained weights), loss.py its training loss.
`architecture(model_or_config)` finds the description from transformers' `config.model_type`.
"""

from __future__ import annotations

import functools
from importlib import import_module

from gptpar.architectures import ARCHITECTURES
from gptpar.errors import GptparError
from gptpar.models.base import Architecture, find_model, packed_attention, packed_examples


def architecture(of: object) -> Architecture:
    """The description of a transformers model, its config, or an architecture's name."""
    name = of if isinstance(of, str) else getattr(getattr(of, "config", of), "model_type", None)
    if name not in ARCHITECTURES:
        raise GptparError(f"gptpar has no description of the architecture {name!r}; it knows "
                          f"{', '.join(ARCHITECTURES)} (gptpar/architectures.py)")
    return _described(name)


@functools.cache
def _described(name: str) -> Architecture:
    """The registry's description of `name`, loaded by its "module:Object" string."""
    module, _, obj = ARCHITECTURES[name].description.partition(":")
    return getattr(import_module(module), obj)


__all__ = ["Architecture", "architecture", "find_model", "packed_attention", "packed_examples"]
