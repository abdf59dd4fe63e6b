"""Parameter names of either pipeline's wrappers mapped back to GPT2LMHeadModel's own, so checkpoints and tests
compare every layout with one model: the one-process `ParallelGPT2` keeps the model as `model.`, the engine's
`PipelineStage`s name blocks by their model index (`stages.<s>.blocks.<i>.block.`)."""

from __future__ import annotations

import torch


def original_name(name: str) -> str:
    """The GPT2LMHeadModel name of a PipelineStage parameter (`blocks.5.block.attn.c_attn.weight` is
    `transformer.h.5.attn.c_attn.weight`), so a pipeline's stages can be compared with one model."""
    part, _, rest = name.partition(".")
    if part == "blocks":
        index, _, inner = rest.partition(".")
        return f"transformer.h.{index}.{inner.removeprefix('block.')}"
    return rest if rest.startswith("lm_head.") else f"transformer.{rest}"


def plain_gpt2_state(model_state: dict[str, torch.Tensor], vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's model state under GPT2LMHeadModel's own names and shapes, whichever wrapper wrote it: the
    one-process `ParallelGPT2` (`model.` prefix) or the pipeline engine's stages (`stages.<s>.` and stage names);
    tensor parallelism's fused q, k, v columns stored as (in, 3, out) are flattened back and its padded vocabulary
    rows cut to `vocab_size`. The tied LM head appears as `lm_head.weight` beside `transformer.wte.weight`, as
    GPT2LMHeadModel.state_dict() has it."""
    plain = {}
    for key, value in model_state.items():
        name = original_name(key.split(".", 2)[2]) if key.startswith("stages.") else key.removeprefix("model.")
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) and value.dim() == 2 + name.endswith("weight"):
            value = value.flatten(-2)
        if vocab_size is not None and name in ("transformer.wte.weight", "lm_head.weight"):
            value = value[:vocab_size]
        plain[name] = value
    if "lm_head.weight" not in plain and "transformer.wte.weight" in plain:
        plain["lm_head.weight"] = plain["transformer.wte.weight"]
    return plain
