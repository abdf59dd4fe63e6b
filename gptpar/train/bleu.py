"""Greedy decoding of validation (and test) prompts and their scores: corpus BLEU (sacrebleu) for
`data.task=translation`, the final answer's exact-match accuracy for `data.task=sft`.

Decoding calls the one forward every layout has (input ids -> logits: one device, layer-split, GPipe, any DP
sync, tensor parallelism) on right-padded rows, each row reading the logits at its own last position. Without a
KV cache every token re-runs the prefix; `train.bleu_samples` caps the cost.

The data-parallel replicas decode interleaved shares of the samples and gather the texts, so every rank scores
the same corpus and logs the same BLEU. Under a sync that shards parameters, or tensor parallelism, a forward is
a collective, so ranks decode in lockstep: after each forward they agree whether any still decodes, and one that
is done runs a one-token forward meanwhile. Ranks without a model (the multi-process pipeline's, whose model is
gathered whole onto one rank per replica to decode) take no share but keep in step the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType

import torch
import torch.distributed as dist

from gptpar.data.pairs import PairData, PairDataset
from gptpar.errors import require_extra
from gptpar.parallel.comm import comm_span

Forward = Callable[[torch.Tensor], torch.Tensor]  # (rows, width) ids on the CPU -> (rows, width, vocab) logits
AnyRank = Callable[[bool], bool]  # a flag OR-ed over the replicas
Decoded = Callable[[int, int], None]  # told (prompts decoded, of how many) as decoding goes


def require_sacrebleu() -> ModuleType:
    """sacrebleu, imported only where BLEU is asked for; the trainer calls this at set-up to fail at once."""
    return require_extra("sacrebleu", "train.bleu_samples > 0", "translation")


ANSWER = re.compile(r"The answer is:?\s*(.+)", re.IGNORECASE)


def final_answer(text: str) -> str:
    """The final answer a response states: what follows its last `The answer is:` (MetaMathQA's convention), else its
    last non-empty line; stripped, a trailing period and thousands separators dropped, so `1,200.` is `1200`."""
    found = ANSWER.findall(text)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    answer = found[-1] if found else (lines[-1] if lines else "")
    return answer.strip().rstrip(".").replace(",", "").strip()


def answers_correct(responses: list[str], references: list[str]) -> list[bool]:
    """Whether each response's final answer equals its reference's (exact match after `final_answer`)."""
    return [final_answer(r) == final_answer(ref) for r, ref in zip(responses, references, strict=True)]


def answer_accuracy(responses: list[str], references: list[str]) -> float:
    """The share of responses whose final answer equals the reference's (`answers_correct`)."""
    if not responses:
        return 0.0
    return sum(answers_correct(responses, references)) / len(responses)


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu's corpus BLEU (0-100) with its default 13a tokenization, one reference per sentence."""
    return float(require_sacrebleu().corpus_bleu(hypotheses, [references]).score)


def _decode_batch(forward: Forward, prompts: list[list[int]], eos: int, max_new: int, any_rank: AnyRank
                  ) -> list[list[int]]:
    """Each prompt continued by argmax until <eos> or `max_new` tokens; the tokens before <eos>."""
    starts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    ids = torch.full((len(prompts), max(map(len, prompts), default=0) + max_new), eos, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    ends, active = starts.clone(), torch.ones(len(prompts), dtype=torch.bool)
    for _ in range(max_new):
        if not any_rank(bool(active.any())):
            break
        if not active.any():
            forward(ids.new_zeros(1, 1))  # this rank is done: keep a sharded model's collectives in step
            continue
        live = active.nonzero().squeeze(1)
        logits = forward(ids[live, :int(ends[live].max())])
        last = (ends[live] - 1).to(logits.device)
        picked = logits[torch.arange(len(live), device=logits.device), last].argmax(-1).cpu()
        ids[live, ends[live]] = picked
        ends[live] += 1
        active[live] = picked != eos
    generated = [ids[row, starts[row]:ends[row]].tolist() for row in range(len(prompts))]
    return [tokens[:-1] if tokens and tokens[-1] == eos else tokens for tokens in generated]


def greedy_decode(forward: Forward, prompts: list[list[int]], eos: int, max_new: int, batch_size: int,
                  any_rank: AnyRank = bool, decoded: Decoded = lambda done, total: None) -> list[list[int]]:
    """`_decode_batch` over batches of similar prompt lengths (less padding), in the prompts' order; `decoded(done,
    total)` after each batch of this rank's prompts (a progress line: decoding takes minutes on a CPU)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]
    start = 0
    while any_rank(start < len(order)):  # a replica out of prompts decodes empty batches until all are
        batch = order[start:start + batch_size]
        start += batch_size
        for index, tokens in zip(batch, _decode_batch(forward, [prompts[i] for i in batch], eos, max_new, any_rank),
                                 strict=True):
            outputs[index] = tokens
        if batch:
            decoded(min(start, len(order)), len(order))
    return outputs


def _any_rank(group: dist.ProcessGroup, device: torch.device) -> AnyRank:
    def any_rank(flag: bool) -> bool:
        tensor = torch.tensor([float(flag)], device=device)
        with comm_span("all_reduce", group=group, nbytes=tensor.nbytes):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return bool(tensor.item())
    return any_rank


def _no_model(ids: torch.Tensor) -> torch.Tensor:
    """The forward of a rank without a model: it has no prompts, so it is only ever asked to keep in step."""
    return ids


def decode_split(forward: Forward | None, data: PairData, split: PairDataset, samples: int, batch_size: int,
                 group: dist.ProcessGroup | None, device: torch.device, share: tuple[int, int] | None = None,
                 decoded: Decoded = lambda done, total: None) -> list[str]:
    """Greedy translations of the first `samples` sources of `split` (data.val or data.test; all of them if it has
    fewer), decoded in interleaved shares and gathered over `group`, so every rank returns all of them. Share (i, n)
    takes samples i, i + n, ... (default: the rank's place in `group` and its size). A rank without a model
    (`forward` None) takes none and keeps in step, so no rank waits in one collective for the whole decoding, which
    parallel.timeout_s would cut. `decoded` hears of this rank's share as it is decoded."""
    samples = min(samples, len(split))
    rank, replicas = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    index, count = share or (rank, replicas)
    mine = list(range(index, samples, count)) if forward is not None else []
    any_rank = _any_rank(group, device) if group is not None else bool
    tokens = greedy_decode(forward or _no_model, [split.prompt(i) for i in mine], data.eos, data.max_new_tokens,
                           batch_size, any_rank, decoded)
    texts = {i: data.text(ids) for i, ids in zip(mine, tokens, strict=True)}
    if group is not None:
        shares: list[dict[int, str] | None] = [None] * replicas
        with comm_span("all_gather", group=group):
            dist.all_gather_object(shares, texts, group=group)
        texts = {i: text for share in shares for i, text in share.items()}
    return [texts[i] for i in range(samples)]
