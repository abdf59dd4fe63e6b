"""The language-model loss on vocabulary shards (loss parallelism): cross-entropy over logits that no rank holds
whole. Three all-reduces of one number per token replace the all-gather of the logits (tokens x vocabulary):
the maximum (for a stable exponent), the sum of exponentials and the target's logit, each summed over the
group. The autograd of `reduce_from_tp` (identity backward) gives each rank the gradient of its own columns,
softmax minus one-hot, without any further communication. As F.cross_entropy, labels equal to `ignore_index`
(translation's source positions and padding) are left out of the mean and get no gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gptpar.parallel.tensor_parallel.comm import all_reduce, reduce_from_tp


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, vocab: int, group: dist.ProcessGroup,
                        ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy over the targets other than `ignore_index` (F.cross_entropy's default) from
    this rank's columns [r*V_local, (r+1)*V_local) of the padded vocabulary; columns at or past `vocab` (padding)
    are masked out."""
    local_vocab = logits.size(-1)
    start = dist.get_rank(group) * local_vocab
    flat = logits.reshape(-1, local_vocab).float()
    columns = torch.arange(start, start + local_vocab, device=flat.device)
    if columns[-1] >= vocab:
        flat = flat.masked_fill(columns >= vocab, float("-inf"))
    peak = all_reduce(flat.detach().amax(-1), group, dist.ReduceOp.MAX)
    shifted = flat - peak[:, None]
    target = targets.reshape(-1)
    mine = (target >= start) & (target < start + local_vocab)
    rows = torch.arange(target.numel(), device=flat.device)
    picked = shifted[rows, (target - start).clamp(0, local_vocab - 1)]  # indexing keeps only indices for backward
    target_logit = reduce_from_tp(torch.where(mine, picked, torch.zeros_like(picked)), group)
    sum_exp = reduce_from_tp(shifted.exp().sum(-1), group)
    return (sum_exp.log() - target_logit)[target != ignore_index].mean()
