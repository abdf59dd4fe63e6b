"""data.task=classify's part of evaluation: the validation accuracy, top-1 and (with 100 classes or more) top-5,
counted from the logits of the same forward passes that give the validation loss. Each replica counts the hits on its
shard; the counts (not the ratios) are summed over the replicas, so the accuracy is that of every image evaluated,
however the shards split them. Other tasks observe nothing (`ValidationScores`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

TOP5_FROM = 100  # classes from which top-5 accuracy is reported (ImageNet's, CIFAR-100's and Food-101's custom)


class ValidationScores:
    """What an evaluation scores beside the loss, from each validation batch's logits and labels: nothing here."""

    def reset(self) -> None:
        """Start counting a new evaluation."""

    def observe(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One validation batch of this replica."""

    def scores(self) -> dict[str, float | None]:
        """The evaluation's fields of the eval and epoch records (a collective where they are summed over replicas:
        every rank calls it)."""
        return {}


class Accuracy(ValidationScores):
    """`accuracy` (top-1) and, for `classes` >= 100, `accuracy_top5`: the share of validation images whose label is
    the top logit (among the top five); `reduce` sums a tensor over the data-parallel replicas in place."""

    def __init__(self, classes: int, reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device):
        self.top5, self.reduce, self.device = classes >= TOP5_FROM, reduce, device
        self.counts = torch.zeros(3, dtype=torch.float64, device=device)  # top-1 hits, top-5 hits, images

    def reset(self) -> None:
        self.counts.zero_()

    def observe(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        ranked = logits.topk(min(5, logits.size(-1)) if self.top5 else 1, dim=-1).indices
        hits = ranked == labels.to(ranked.device)[:, None]
        self.counts += torch.stack([hits[:, 0].sum(), hits.any(dim=-1).sum(),
                                    torch.tensor(labels.numel(), device=hits.device)]).to(self.counts)

    def scores(self) -> dict[str, float | None]:
        top1, top5, images = self.reduce(self.counts.clone()).tolist()
        shares = {"accuracy": top1 / images if images else None}
        return shares | ({"accuracy_top5": top5 / images if images else None} if self.top5 else {})
