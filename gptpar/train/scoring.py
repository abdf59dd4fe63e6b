"""The epoch record's task scores, apart from the training step: greedy decoding of validation (and test) prompts
wherever the layout lets a forward run, translation's BLEU and sft's answer accuracy (gptpar.train.bleu scores them).

Decoding has no KV cache and runs for minutes on a CPU, so rank 0 says how far it got on the progress channel,
and sft keeps each epoch's decoded answers in the run folder (gptpar.run.logfile.write_answers): a 0% accuracy
can be read there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from gptpar.config import Config
from gptpar.data.pairs import PairData, PairDataset
from gptpar.models import architecture
from gptpar.models.build import empty_model
from gptpar.parallel.comm import comm_span
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.pipeline.names import plain_state
from gptpar.parallel.tensor_parallel.state import whole
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import Answer, write_answers
from gptpar.train.bleu import Decoded, answer_accuracy, answers_correct, corpus_bleu, decode_split
from gptpar.train.precision import Precision
from gptpar.train.progress import Progress

Scores = dict[str, float | None]


class Scoring:
    """Decodes with the trainer's model (`net`, as parallelize wrapped it) and scores the task at an epoch's end."""

    def __init__(self, cfg: Config, dims: ParallelDims, folder: RunFolder, net: nn.Module, precision: Precision,
                 pairs: PairData | None, whole_logits: Any, model_config: PretrainedConfig, pipeline: bool,
                 micro_batch: int):
        self.cfg, self.dims, self.folder, self.net, self.precision = cfg, dims, folder, net, precision
        self.pairs, self.whole_logits, self.model_config = pairs, whole_logits, model_config
        self.pipeline, self.micro_batch = pipeline, micro_batch
        self.progress: Progress | None = None  # the run's progress channel, once it runs

    def scores(self, epoch: int | None = None) -> Scores:
        """The epoch record's scores of the task: translation's BLEU, sft's answer accuracy (its answers kept as
        epoch `epoch`'s, when given); {} for lm."""
        if self.pairs is None:
            return {}
        return self.bleu() if self.cfg.data.task == "translation" else self.answer_accuracy(epoch)

    def answer_accuracy(self, epoch: int | None = None) -> Scores:
        """`answer_accuracy`: the share of the first train.answer_samples validation prompts whose greedy response
        states the reference's final answer (gptpar.train.bleu.final_answer); None when train.answer_samples=0.
        Rank 0 writes the answers of epoch `epoch` (when given) to the run folder."""
        samples, val = self.cfg.train.answer_samples, self.pairs.val
        if not samples:
            return {"answer_accuracy": None}
        (responses,) = self.translate(samples, [val], "answers")
        references = val.references[:len(responses)]
        if epoch is not None and self.dims.rank == 0:
            correct = answers_correct(responses, references)
            write_answers(self.folder.path, epoch, [
                Answer(self.pairs.text(val.prompt(i)), response, reference, ok)
                for i, (response, reference, ok) in enumerate(zip(responses, references, correct, strict=True))])
        return {"answer_accuracy": answer_accuracy(responses, references)}

    def bleu(self) -> Scores:
        """The epoch record's BLEU fields: `bleu`, corpus BLEU of the first train.bleu_samples validation pairs'
        translations (None when train.bleu_samples=0), and `test_bleu`, the same of the test split's, only where
        the source has one and BLEU is on."""
        data, samples = self.pairs, self.cfg.train.bleu_samples
        if not samples:
            return {"bleu": None}
        scored = {"bleu": data.val} | ({"test_bleu": data.test} if data.test is not None else {})
        texts = self.translate(samples, list(scored.values()), "BLEU")
        return {key: corpus_bleu(hypotheses, split.references[:len(hypotheses)])
                for (key, split), hypotheses in zip(scored.items(), texts, strict=True)}

    def _decoded(self, what: str) -> Decoded:
        """A progress line per decoded batch of this rank's share (rank 0's is shown)."""
        progress = self.progress
        if progress is None:
            return lambda done, total: None
        return lambda done, total: progress.message(f"decoding for {what}: {done}/{total} prompts")

    @torch.no_grad()
    def translate(self, samples: int, splits: Sequence[PairDataset], what: str = "scores") -> list[list[str]]:
        """Greedy responses (translations) to the first `samples` prompts of each split (validation, test), decoded by
        the replicas in shares of per-replica micro-batches and gathered (every rank returns all). Tensor parallelism
        decodes on every rank of the tp group in lockstep (its forward is a collective); the multi-process pipeline
        on its model gathered whole once for all the splits (`_whole_model`), one rank per replica, while the other
        ranks keep in step."""
        self.net.eval()
        self.precision.set_matmul_precision()
        batch, device = self.micro_batch // self.dims.size("dp"), self.dims.device
        with self.precision.autocast():
            if self.pipeline:
                model = self._whole_model()
                forward = (lambda ids: model(ids.to(device)).logits) if model is not None else None
                group, share = dist.group.WORLD, (self.dims.coord("dp"), self.dims.size("dp"))
            else:
                forward, group, share = self._decode_logits, self.dims.group("dp"), None
            return [decode_split(forward, self.pairs, split, samples, batch, group, device, share, self._decoded(what))
                    for split in splits]

    def _decode_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole logits of `ids`, right-padded to the batches' fixed width where there is one (sequence
        parallelism's equal shards): causal attention keeps the real positions' logits as they were."""
        if (width := self.pairs.width) is not None:
            ids = F.pad(ids, (0, width - ids.size(1)), value=self.pairs.eos)
        return self.whole_logits(self.net(ids.to(self.net.input_device)))

    def _whole_model(self) -> PreTrainedModel | None:
        """The pipeline's model as one model on each replica's first-stage rank of tp coordinate 0 (None
        on the others): every stage's parameters made whole over the tp group and gathered over the pp group, named
        as the checkpoint export names them (`plain_state`). Memory: while it decodes, that rank holds a
        second, whole copy of the parameters (no gradients, no optimizer state) beside its stage, and the gathered
        pieces once more on the host; a model that cannot fit one device whole cannot be scored this way
        (train.bleu_samples=0 turns BLEU off)."""
        tp_group = self.dims.group("tp")
        pieces = {name: whole(p, tp_group).cpu() for name, p in self.net.named_parameters()}  # tp collectives
        if self.dims.coord("tp") != 0:
            return None
        first = self.dims.coord("pp") == 0
        gathered: list[Any] | None = [None] * self.dims.size("pp") if first else None
        with comm_span("gather", group=self.dims.group("pp")):
            dist.gather_object(pieces, gathered, dst=self.dims.group_ranks("pp")[0], group=self.dims.group("pp"))
        if not first:
            return None
        model = empty_model(self.model_config)
        arch = architecture(model)
        model.load_state_dict(plain_state({name: p for piece in gathered for name, p in piece.items()}, arch),
                              assign=True)
        arch.restore_buffers(model, self.dims.device)
        return model.to(self.dims.device).eval()
