"""GPT-2's pieces as pipeline stages hold them, and where to cut the blocks into stages; shared by the
one-process modes (one_process/gpt2.py) and the multi-process engine (engine/stages.py).

The pieces wrap the original model's submodules (`Embedding`, `Block`, `Head`), so a staged model's parameters
stay the model's own. `balanced_sizes` chooses how many contiguous blocks each stage gets.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
from torch import nn
from transformers import GPT2LMHeadModel

# Attention implementations that apply the causal mask themselves when given no mask.
_IMPLICIT_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3")


def implicit_causal(model: GPT2LMHeadModel) -> bool:
    """Whether the model's attention masks the future itself, so `Block` passes it no mask."""
    return model.config._attn_implementation in _IMPLICIT_CAUSAL


class Embedding(nn.Module):
    """Token plus position embeddings, then dropout, as GPT2Model does it."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


def causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """Additive (1, 1, T, T) mask hiding future positions, for attention that needs it explicit."""
    t = hidden.size(1)
    future = torch.ones(t, t, dtype=torch.bool, device=hidden.device).triu(1)
    mask = torch.zeros(t, t, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(future, torch.finfo(hidden.dtype).min)[None, None]


class Block(nn.Module):
    """A GPT2Block that carries hidden states only, whatever the transformers version returns."""

    def __init__(self, block: nn.Module, implicit_causal: bool) -> None:
        super().__init__()
        self.block, self.implicit_causal = block, implicit_causal

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = None if self.implicit_causal else causal_mask(hidden)
        out = self.block(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Final layer norm and LM head."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def untie_lm_head(model: GPT2LMHeadModel) -> None:
    """Give the LM head its own copy of the embedding matrix, for stages on different devices or ranks: copying
    the shared matrix across them on every step would cost a vocab x width transfer each way. Logits are unchanged
    at that moment; `config.tie_word_embeddings` is set to False so transformers never re-ties the two."""
    wte = model.transformer.wte.weight
    head = nn.Parameter(wte.detach().clone())
    head.__dict__.update(wte.__dict__)  # what describes the tensor (a tensor-parallel piece's layout) holds for both
    model.lm_head.weight = head
    model.config.tie_word_embeddings = False


def stage_sizes(weights: list[int], n_stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Contiguous blocks per stage (at least one each) minimising the heaviest stage's load.

    `first` and `last` are fixed loads of the first and last stage (embeddings, head).
    Among equally good cuts, earlier stages get more blocks: the last stage carries the LM head.
    """
    n_blocks = len(weights)
    prefix = [0, *itertools.accumulate(weights)]
    inf = float("inf")
    # best[s][k]: lowest possible heaviest load when the first s stages hold the first k blocks.
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        fixed = (first if s == 1 else 0) + (last if s == n_stages else 0)
        for k in range(s, n_blocks - (n_stages - s) + 1):
            for a in range(k - 1, s - 2, -1):
                load = max(best[s - 1][a], prefix[k] - prefix[a] + fixed)
                if load < best[s][k]:
                    best[s][k], cut[s][k] = load, a
    sizes, k = [], n_blocks
    for s in range(n_stages, 0, -1):
        sizes.append(k - cut[s][k])
        k = cut[s][k]
    return sizes[::-1]


def _even_sizes(n_blocks: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_blocks, n_stages)
    return [base + (i < extra) for i in range(n_stages)]


def _timed(fn) -> float:
    """Median seconds of a few calls (the first, which may allocate, left out)."""
    times = []
    for _ in range(4):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measured_loads(model: GPT2LMHeadModel, sample: tuple[int, int], device: torch.device
                   ) -> tuple[float, float, float]:
    """Forward+backward seconds of the embeddings, one block and the final norm with LM head on a
    (micro-batch, seq_len) sample: GPT-2's blocks are all alike, so one block stands for each."""
    tr = model.transformer
    implicit = implicit_causal(model)
    embed = Embedding(tr.wte, tr.wpe, tr.drop).to(device)
    block, head = Block(tr.h[0], implicit).to(device), Head(tr.ln_f, model.lm_head).to(device)
    ids = torch.zeros(sample, dtype=torch.long, device=device)
    hidden = torch.zeros(*sample, model.config.n_embd, device=device, requires_grad=True)

    def run(module: nn.Module, x: torch.Tensor) -> None:
        module(x).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    loads = tuple(_timed(lambda m=m, x=x: run(m, x)) for m, x in ((embed, ids), (block, hidden), (head, hidden)))
    model.zero_grad(set_to_none=True)
    return loads


def balanced_sizes(model: GPT2LMHeadModel, n_stages: int, balance: str, separate_head: bool,
                   sample: tuple[int, int] = (1, 64), device: torch.device | None = None) -> list[int]:
    """Blocks per stage under parallel.balance: equal counts (`layers`), equal parameter counts
    (`params`, the head counted on the last stage when it is a copy of its own) or equal measured
    time (`time`, on `device` with a `sample` of (micro-batch, seq_len) tokens)."""
    tr = model.transformer
    blocks = list(tr.h)
    if balance == "params":
        numel = [sum(p.numel() for p in b.parameters()) for b in blocks]
        first = sum(p.numel() for p in (*tr.wte.parameters(), *tr.wpe.parameters()))
        last = sum(p.numel() for p in tr.ln_f.parameters()) + (model.lm_head.weight.numel() if separate_head else 0)
        return stage_sizes(numel, n_stages, first, last)
    if balance == "time":
        first, block, last = measured_loads(model, sample, device or torch.device("cpu"))
        return stage_sizes([block] * len(blocks), n_stages, first, last)
    return _even_sizes(len(blocks), n_stages)
