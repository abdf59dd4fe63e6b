"""The multi-process engine's stages: the model cut into contiguous blocks per stage, one module per stage a rank
holds, built from the architecture's pieces (gptpar/models)."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import PreTrainedModel

from gptpar.models import architecture
from gptpar.parallel.pipeline.cuts import untie_lm_head


class PipelineStage(nn.Module):
    """One stage of the multi-process pipeline: contiguous blocks, with the embeddings on the first
    stage and the final norm and LM head on the last. Blocks keep their model index in their names
    (`blocks.5.block...`), so checkpoint keys say which block a tensor belongs to (`names` maps them back)."""

    def __init__(self, model: PreTrainedModel, index: int, n_stages: int, first_block: int, n_blocks: int) -> None:
        super().__init__()
        arch = architecture(model)
        self.index, self.is_first, self.is_last = index, index == 0, index == n_stages - 1
        self.embed = arch.embed_piece(model) if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): arch.block_piece(model, i)
                                     for i in range(first_block, first_block + n_blocks)})
        self.head = arch.head_piece(model) if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            hidden = block(hidden)
        return self.head(hidden) if self.head is not None else hidden


def pipeline_stages(model: PreTrainedModel, stage_ids: list[int], sizes: list[int]) -> list[PipelineStage]:
    """The listed stages of the model cut into len(sizes) stages of sizes[s] blocks. A tied LM head gets
    its own copy of the embedding matrix (the first and last stage live on different ranks; the
    engine sums the two copies' gradients every step, which keeps them equal)."""
    if model.config.tie_word_embeddings:
        untie_lm_head(model)
    starts = [0, *itertools.accumulate(sizes)]
    return [PipelineStage(model, s, len(sizes), starts[s], sizes[s]) for s in stage_ids]
