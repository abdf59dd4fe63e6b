"""Parameter names of either pipeline's wrappers mapped back to the model's own, so checkpoints and tests compare
every layout with one model: the one-process `ParallelGPT2` keeps the model as `model.`, the engine's
`PipelineStage`s name blocks by their model index (`stages.<s>.blocks.<i>.block.`) and the embedding and head
pieces' parts by their names in the decoder body (gptpar/models)."""

from __future__ import annotations

import torch

from gptpar.models import Architecture


def original_name(name: str, arch: Architecture) -> str:
    """The model's name of a PipelineStage parameter (GPT-2's `blocks.5.block.attn.c_attn.weight` is
    `transformer.h.5.attn.c_attn.weight`), so a pipeline's stages can be compared with one model."""
    part, _, rest = name.partition(".")
    if part == "blocks":
        index, _, inner = rest.partition(".")
        return f"{arch.block_prefix}.{index}.{inner.removeprefix('block.')}"
    return rest if rest.startswith("lm_head.") else f"{arch.body}.{rest}"


def model_name(name: str, arch: Architecture) -> str:
    """A parameter's checkpoint name (after the trainer's `model.`) as the one-process model names it, whichever
    layout wrote it: the pipeline engine's `stages.<s>.<stage name>` as `model.<the model's name>`, others as they are
    (gptpar.train.reshard reads a checkpoint of one layout into another by these names)."""
    if not name.startswith("stages."):
        return name
    return "model." + original_name(name.split(".", 2)[2], arch)


def plain_state(model_state: dict[str, torch.Tensor], arch: Architecture, vocab_size: int | None = None
                ) -> dict[str, torch.Tensor]:
    """A checkpoint's model state under the model's own names and shapes, whichever wrapper wrote it: the
    one-process `ParallelGPT2` (`model.` prefix) or the pipeline engine's stages (`stages.<s>.` and stage names);
    GPT-2 tensor parallelism's fused q, k, v columns stored as (in, 3, out) are flattened back and padded vocabulary
    rows cut to `vocab_size`. A tied LM head appears as `lm_head.weight` beside the token table, as the model's
    state_dict() has it."""
    plain = {}
    tables = (arch.token_table, "lm_head.weight")
    for key, value in model_state.items():
        name = original_name(key.split(".", 2)[2], arch) if key.startswith("stages.") else key.removeprefix("model.")
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) and value.dim() == 2 + name.endswith("weight"):
            value = value.flatten(-2)
        if vocab_size is not None and name in tables:
            value = value[:vocab_size]
        plain[name] = value
    if "lm_head.weight" not in plain and arch.token_table in plain:
        plain["lm_head.weight"] = plain[arch.token_table]
    return plain
