"""Where to cut a model's blocks into stages, shared by the one-process modes (one_process/gpt2.py) and the
multi-process engine (engine/stages.py). The pieces themselves (embedding, block, head) are the architecture's
(gptpar/models): they wrap the original model's submodules, so a staged model's parameters stay the model's own.
`balanced_sizes` chooses how many contiguous blocks each stage gets.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from transformers import PreTrainedModel

from gptpar.models import architecture
from gptpar.strategies.pipeline import even_sizes, stage_sizes


def untie_lm_head(model: PreTrainedModel) -> None:
    """Give the LM head its own copy of the embedding matrix, for stages on different devices or ranks: copying
    the shared matrix across them on every step would cost a vocab x width transfer each way. Logits are unchanged
    at that moment; `config.tie_word_embeddings` is set to False so transformers never re-ties the two."""
    table = architecture(model).token_embedding(model).weight
    head = nn.Parameter(table.detach().clone())
    head.__dict__.update(table.__dict__)  # what describes the tensor (a tensor-parallel piece's layout) holds for both
    model.lm_head.weight = head
    model.config.tie_word_embeddings = False


def _timed(fn) -> float:
    """Median seconds of a few calls (the first, which may allocate, left out)."""
    times = []
    for _ in range(4):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measured_loads(model: PreTrainedModel, sample: tuple[int, int], device: torch.device
                   ) -> tuple[float, float, float]:
    """Forward+backward seconds of the embeddings, one block and the final norm with LM head on a
    (micro-batch, seq_len) sample: the blocks are all alike, so one block stands for each."""
    arch = architecture(model)
    embed, block, head = (m.to(device) for m in (arch.embed_piece(model), arch.block_piece(model, 0),
                                                 arch.head_piece(model)))
    ids = torch.zeros(sample, dtype=torch.long, device=device)
    hidden = torch.zeros(*sample, model.config.hidden_size, device=device, requires_grad=True)

    def run(module: nn.Module, x: torch.Tensor) -> None:
        module(x).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    loads = tuple(_timed(lambda m=m, x=x: run(m, x)) for m, x in ((embed, ids), (block, hidden), (head, hidden)))
    model.zero_grad(set_to_none=True)
    return loads


def balanced_sizes(model: PreTrainedModel, n_stages: int, balance: str, separate_head: bool,
                   sample: tuple[int, int] = (1, 64), device: torch.device | None = None) -> list[int]:
    """Blocks per stage under parallel.balance: equal counts (`layers`), equal parameter counts
    (`params`, the head counted on the last stage when it is a copy of its own) or equal measured
    time (`time`, on `device` with a `sample` of (micro-batch, seq_len) tokens)."""
    arch = architecture(model)
    blocks = list(arch.blocks(model))
    if balance == "params":
        numel = [sum(p.numel() for p in b.parameters()) for b in blocks]
        first = sum(p.numel() for p in arch.embed_piece(model).parameters())
        norm = getattr(arch.decoder(model), arch.final_norm)
        last = sum(p.numel() for p in norm.parameters()) + (model.lm_head.weight.numel() if separate_head else 0)
        return stage_sizes(numel, n_stages, first, last)
    if balance == "time":
        first, block, last = measured_loads(model, sample, device or torch.device("cpu"))
        return stage_sizes([block] * len(blocks), n_stages, first, last)
    return even_sizes(len(blocks), n_stages)
