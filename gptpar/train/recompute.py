"""Activation checkpointing and torch.compile of the model (each transformer block, or the whole model), leaving the
module tree alone.

Both act on module instances, never on the tree: parameter names, state dicts, checkpoints and the
pipeline's split by block are the same with or without them, and every parallelism that wraps or splits
the model afterwards (fsdp's hooks, the pipeline's stages, Pipe's partitions) finds the blocks it expects.
Whole-model compilation (`train.compile=model`) gives one graph for forward and one for backward, with no
Python between the layers, where the layout runs the model as one piece (gptpar.config.whole_compile_obstacle).
Where a rank compiles, the loss is compiled too (train.loss_kernel=auto): inductor fuses the cross-entropy into one
pass over the logits each way, where eager kernels make an fp32 copy and several passes over it.

Checkpointing replaces a block's `forward` by one that runs the original under non-reentrant
`torch.utils.checkpoint`: forward keeps only the block's input, backward runs the block again to get the
rest. The recompute calls the original forward directly, so the block's module hooks fire once per step,
not again in backward; fsdp relies on that (its backward hook on the block's output has gathered the
parameters before the recompute needs them). The RNG state is saved at the block's forward and restored
for the recompute, so dropout draws the same masks.

Blocks i with i % k == 0 are checkpointed (`gptpar.config.checkpointed_indices`): ceil(n_layer / k) of n_layer.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from gptpar.config import Config, checkpoint_interval, checkpointed_indices, whole_compile_obstacle
from gptpar.errors import GptparError
from gptpar.models import architecture
from gptpar.models.loss import chunked_lm_loss, class_loss, lm_loss
from gptpar.parallel.placement import resolve_devices


def _checkpointed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's own forward under checkpoint (preserve_rng_state, the default: dropout replays its masks)."""
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: PreTrainedModel, k: int) -> list[int]:
    """Checkpoint every k-th block of `model` in place (see the module docstring); returns their indices."""
    blocks = architecture(model).blocks(model)
    indices = checkpointed_indices(len(blocks), k)
    for i in indices:
        # An instance attribute, so the tree is unchanged; a bound method, so a deep copy binds to the copied block.
        blocks[i].forward = types.MethodType(_checkpointed_forward, blocks[i])
    return indices


def _reason(exc: BaseException) -> str:
    """The first line of the innermost cause (dynamo wraps a backend's own error as its inner_exception)."""
    while (inner := getattr(exc, "inner_exception", None) or exc.__cause__) is not None:
        exc = inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def check_compiler(device: torch.device, backend: str | Callable = "inductor", key: str = "train.compile=true",
                   fix: str = "set train.compile=false") -> None:
    """Compilation is lazy, so a small function is compiled and run on `device` first: a backend that cannot work
    here fails now, as one line naming `key` and the `fix`, not inside the first step."""
    try:
        torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.ones(2, device=device))
    except Exception as exc:  # whatever torch raises (no C++ compiler, unsupported platform): one line
        raise GptparError(f"{key}: torch.compile does not work here ({_reason(exc)}); {fix}") from None


def compile_blocks(model: PreTrainedModel, device: torch.device, backend: str | Callable = "inductor",
                   whole: bool = False) -> None:
    """torch.compile each block (or with `whole` the model itself) in place: names kept, and wrappers applied
    afterwards call the compiled forward."""
    check_compiler(device, backend, f"train.compile={'model' if whole else 'blocks'}")
    for module in [model] if whole else architecture(model).blocks(model):
        module.compile(backend=backend)


def compile_mode(cfg: Config, device: torch.device) -> str:
    """train.compile as this rank runs it: false, blocks or model (`true` is blocks, as before there was model);
    `auto` is false on a CPU (compiling takes minutes there) and for a mixture of experts, on a GPU model for one
    replica of one process (where data parallelism would lose its overlap of communication with backward) and blocks
    elsewhere."""
    setting = cfg.train.compile
    if setting in ("false", "blocks", "model"):
        return setting
    if setting == "true":
        return "blocks"
    if device.type != "cuda" or cfg.model.shape().moe:  # a mixture's routers are watched by hooks, uncompiled
        return "false"
    one_replica = cfg.parallel.dp == 1 and not whole_compile_obstacle(cfg)
    return "model" if one_replica else "blocks"


def loss_kernel(cfg: Config, device: torch.device) -> str:
    """train.loss_kernel as this rank runs it: compiled, chunked or plain (auto: compiled where the rank compiles)."""
    if cfg.data.task == "classify":  # one row of class logits per image: F.cross_entropy in fp32 (class_loss)
        return "plain"
    if cfg.train.loss_kernel != "auto":
        return cfg.train.loss_kernel
    return "compiled" if compile_mode(cfg, device) != "false" else "chunked"


def whole_logits_loss(cfg: Config, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The cross-entropy of whole logits that train.loss_kernel asks for on this rank (an image classifier's own)."""
    if cfg.data.task == "classify":
        return class_loss
    kernel = loss_kernel(cfg, device)
    if kernel == "compiled":
        if compile_mode(cfg, device) == "false":  # else prepare_blocks has checked the compiler already
            check_compiler(device, cfg.train.compile_backend, "train.loss_kernel=compiled",
                           "set train.loss_kernel=chunked")
        return torch.compile(lm_loss, backend=cfg.train.compile_backend)
    return chunked_lm_loss if kernel == "chunked" else lm_loss


def _check_pipe_dropout(cfg: Config) -> None:
    """Pipe runs its partitions in threads; partitions sharing a device draw dropout masks from one generator at
    the same time, so the RNG state a block saved would not replay its masks in the recompute."""
    p = cfg.parallel
    if p.pp_mode != "pipeline_parallel" or cfg.model.dropout == 0:
        return
    devices = resolve_devices(p.devices)
    if len(set(devices)) < len(devices):
        raise GptparError(f"train.activation_checkpointing={cfg.train.activation_checkpointing} with "
                          f"parallel.pp_mode=pipeline_parallel and model.dropout={cfg.model.dropout} needs a device "
                          f"per stage (parallel.devices={p.devices!r} repeats one); list distinct devices, set "
                          "model.dropout=0 or use parallel.pp_mode=model_parallel")


def prepare_blocks(model: PreTrainedModel, cfg: Config, device: torch.device) -> None:
    """What train.activation_checkpointing and train.compile ask of a freshly built model (on any device, meta
    included), before it is materialised, wrapped or split into stages."""
    k = checkpoint_interval(cfg.train.activation_checkpointing)
    if k:
        _check_pipe_dropout(cfg)
        checkpoint_blocks(model, k)
    if (mode := compile_mode(cfg, device)) != "false":
        compile_blocks(model, device, cfg.train.compile_backend, whole=mode == "model")
