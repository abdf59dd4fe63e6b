"""The training loss of a model's logits: plain next-token cross-entropy, and a chunked kernel of the same value that
never holds the whole logits in fp32 (train.loss_kernel=chunked)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; targets are already shifted by one (see gptpar.data)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def no_target_loss(logits: torch.Tensor) -> torch.Tensor:
    """The loss of logits whose labels hold no target (a cp rank's shard of pair rows holding only prompt and
    padding; their mean would be 0/0): a zero that still runs the backward its peers' collectives wait for, with zero
    gradients. A padded head's columns are -inf (gptpar.models.build.PaddedHead), which times 0 would make NaN."""
    return torch.where(logits.isfinite(), logits, 0).sum() * 0


CHUNK_ELEMENTS = 2**26  # logits per chunk of chunked_lm_loss: 256 MB in fp32


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over the rows whose target is not -100, computed chunk by chunk of `rows` rows in fp32.
    Forward keeps only each row's log-sum-exp beside the logits themselves (which the head produced anyway);
    backward recomputes each chunk's softmax and writes its gradient, (softmax - one-hot) x grad / count, straight
    into a gradient of the logits' own dtype. So neither pass holds more than one chunk in fp32, where the plain
    loss keeps fp32 log-probabilities of every logit from forward to backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        flat, target = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        keep = target != -100
        index = target.clamp(min=0)[:, None]
        lse = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.size(0), rows):
            chunk, part = flat[start:start + rows].float(), slice(start, start + rows)
            lse[part] = chunk.logsumexp(-1)
            total += ((lse[part] - chunk.gather(1, index[part]).squeeze(1)) * keep[part]).sum()
        count = keep.sum()
        ctx.save_for_backward(logits, index, keep, lse, count)
        ctx.rows = rows
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, index, keep, lse, count = ctx.saved_tensors
        flat = logits.reshape(-1, logits.size(-1))
        out = torch.empty_like(flat)
        weight = keep * (grad / count)  # per row: 0 for an ignored target
        for start in range(0, flat.size(0), ctx.rows):
            part = slice(start, start + ctx.rows)
            probs = (flat[part].float() - lse[part, None]).exp_()
            probs.scatter_add_(1, index[part], -torch.ones_like(lse[part, None]))
            out[part] = probs.mul_(weight[part, None])
        return out.view_as(logits), None, None


def chunked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS
                    ) -> torch.Tensor:
    """`lm_loss` without an fp32 copy of the whole logits (train.loss_kernel=chunked): the same value and gradients up
    to fp32 rounding, -100 targets left out of the mean as F.cross_entropy leaves them."""
    return _ChunkedCrossEntropy.apply(logits, targets, max(1, chunk_elements // logits.size(-1)))


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """An image classifier's loss (data.task=classify): the mean cross-entropy of each image's class logits [B, C]
    against its label [B], in fp32. One row per image, so none of the language kernels' memory concerns apply."""
    return F.cross_entropy(logits.float(), labels)
