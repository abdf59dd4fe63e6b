"""Training FLOPs per token from the model shape, and a device's dense peak: what the report's MFU (analysis.mfu) and
the planner's (gptpar.plan.predict) both divide, kept here below both so that neither imports the other.

Model FLOPs per token (what the model needs, whatever the implementation does):
    6·N + 6·V·d + 12·L·H·Q·T
N the parameters of the blocks and the final norm (2 FLOPs per multiply-add, ×3 for forward and
backward; the architecture's blocks: GPT-2's 12d² + 13d, or the Llama family's grouped-query attention
and gated MLP; a mixture of experts counts the parameters a token goes through, its router, top-k of its experts
and the shared one, gptpar.presets.ModelShape.active_block_parameters), 6·V·d the LM head's vocabulary
projection (2·V·d forward, tied or not), 12·L·H·Q·T attention's score and value products over every
query head (L layers, H heads, Q head width, T sequence length). Hardware FLOPs add the forward of
every block that activation checkpointing recomputes: 2·N_blocks/L + 4·H·Q·T per recomputed block.
MFU divides model FLOPs, HFU hardware FLOPs, by the devices' dense peak.

An image classifier (ViT) has no LM head. Its T is an image's patches and class token (the model's n_positions,
what a step record counts as its tokens), and per image it runs
    6·N·T + 12·L·H·Q·T² + 6·(3·P²·d + d)·patches + 6·(d + 1)·C
the blocks and final norm over every position, attention, the patch projection (a P x P convolution of 3
channels, as a linear layer over each patch) and the classifier over the class token alone (C classes, with its
bias); per token, that over T.

Under LoRA (train.lora_rank > 0) a frozen weight gets no gradient of its own: it costs 4 FLOPs per use (forward and
input gradient) where a trained one costs 6, so 4·N + 6·A + 4·V·d + 12·L·H·Q·T, A the adapters of the blocks
(gptpar.adapters: r·(in + out) per adapted layer), and a ViT's patch projection 4 and its classifier, which trains
whole, 6. Adapters outside the blocks (on a table or the head) are not counted: r·(V + d) against V·d.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptpar.adapters import Trainable
from gptpar.hardware import peaks_of
from gptpar.presets import ModelShape


@dataclass(frozen=True)
class FlopsShape:
    """What the FLOPs of one trained token depend on."""

    model: ModelShape
    seq_len: int  # positions of one example: data.seq_len, or an image's patches and class token
    vocab_size: int  # the LM head's rows, or an image classifier's classes
    recomputed_blocks: int = 0  # blocks whose forward activation checkpointing runs twice
    lora: Trainable | None = None  # train.lora_rank > 0: what trains (gptpar.adapters); None: every weight


def flops_per_token(shape: FlopsShape) -> float:
    """Model FLOPs of training on one token: 6N + 6·V·d + 12·L·H·Q·T, or an image classifier's per image over its
    T positions; under LoRA 4 per frozen weight and 6 per adapter weight of the blocks (module docstring)."""
    m, trained = shape.model, (6.0 if shape.lora is None else 4.0)
    n_params = m.n_layer * m.active_block_parameters() + m.norm_parameters()
    blocks = trained * n_params + (6.0 * shape.lora.blocks if shape.lora else 0.0)
    attention = 12.0 * m.n_layer * m.n_head * m.head_dim * shape.seq_len
    head = 6.0 if shape.lora is None or shape.lora.head_whole else 4.0
    if m.patch_size:
        patch_projection = trained * (3 * m.patch_size ** 2 * m.n_embd + m.n_embd) * m.patches
        classifier = head * (m.n_embd + 1) * shape.vocab_size
        return ((blocks + attention) * shape.seq_len + patch_projection + classifier) / shape.seq_len
    return blocks + head * shape.vocab_size * m.n_embd + attention


def hardware_flops_per_token(shape: FlopsShape) -> float:
    """Model FLOPs plus one more forward of every recomputed block (2 FLOPs per weight, its adapters' under LoRA,
    4·H·Q·T attention)."""
    m = shape.model
    adapters = shape.lora.blocks / m.n_layer if shape.lora else 0.0
    recompute_forward = 2.0 * (m.active_block_parameters() + adapters) + 4.0 * m.n_head * m.head_dim * shape.seq_len
    return flops_per_token(shape) + shape.recomputed_blocks * recompute_forward


def peak_flops(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of a device in a precision; None for a device or precision the datasheets lack."""
    return (peaks_of(device_name) or {}).get(precision)
