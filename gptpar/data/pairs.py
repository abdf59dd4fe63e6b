"""Prompt/response pairs for the two pair tasks, read, tokenized, and served as `source <sep> target <eos>`:
`data.task=translation` (German to English) and `data.task=sft` (instruction tuning on question/response pairs,
MetaMathQA's `query` and `response` by default: data.prompt_field, data.response_field). gptpar.data.templates
frames each pair: the plain template (the prompt's tokens, a separator, the response's tokens, an end token), or for
sft the chat template of a save_pretrained folder's tokenizer (data.tokenizer=pretrained:PATH).

Sources: `jsonl:TRAIN[,VALID[,TEST]]` (one object per line: translation's `{"de": ..., "en": ...}` or the hub's own
`{"translation": {"de": ..., "en": ...}}`, sft's the two fields), for translation `tsv:TRAIN[,VALID[,TEST]]`
(`de<TAB>en` per line), `hf:NAME[:CONFIG]` (the `train` and `validation` splits, and `test` where the dataset has
one; for sft a dataset without a validation split, as MetaMathQA, is held out from its train split as one file
is) and for sft `metamath_sample` (320 grade-school problems bundled in MetaMathQA's schema, written for gptpar:
gptpar/data/samples). One local file is split by position: the last `data.val_fraction` of its pairs is held out.
`data.max_chars` caps the training pairs read (0: all); what it dropped is said in the run's banner, and in the
error when too few pairs are left to train. A split without pairs fails naming its file, or the key that emptied
it. A test split is optional: it is only decoded and scored (`test_bleu`), never trained or evaluated on.

The tokenizer is the run's (`data.tokenizer`: GPT-2's, a BPE trained on both sides of the training pairs, or a
folder's); with gptpar's own, two ids past its vocabulary are reserved for <sep> and <eos>, so no text can be
mistaken for them, and a folder's tokenizer brings its own end token.

Labels are the inputs shifted by one, as for language modelling, with every position that predicts a prompt
token (and padding) set to IGNORE: the loss counts the response's tokens and its end token only. Batches are padded on
the right to their longest example, or to one fixed width where shapes must not vary (gptpar.config.fixed_width);
causal attention means no real position ever sees the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from filelock import FileLock
from torch.utils.data import Dataset

from gptpar.config import DataConfig
from gptpar.data.pair_files import Pair, read_pairs
from gptpar.data.sources import cache_dir
from gptpar.data.templates import end_tokens, frame
from gptpar.data.tokenizer import Tokenizer, get_tokenizer

IGNORE = -100  # the label cross-entropy skips (torch's ignore_index)


class PairDataset(Dataset):
    """Tokenized pairs framed by their template (gptpar.data.templates); items are (inputs, labels) of one example."""

    def __init__(self, pairs: list[Pair], tokenizer: Tokenizer, cfg: DataConfig):
        self.prompts, self.responses = frame(pairs, tokenizer, cfg, f"data.tokenizer={cfg.tokenizer}")
        self.eos = end_tokens(tokenizer)[1]
        self.references = [response.strip() for _, response in pairs]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = self.prompts[index]
        ids = torch.from_numpy(np.concatenate([prompt, self.responses[index]]))
        labels = ids[1:].clone()
        labels[:len(prompt) - 1] = IGNORE  # the positions that predict the prompt's own tokens
        return ids[:-1], labels

    def prompt(self, index: int) -> list[int]:
        """What decoding starts from."""
        return self.prompts[index].tolist()


def target_tokens(labels: torch.Tensor) -> int:
    """The labels the loss counts: target tokens and <eos>."""
    return int((labels != IGNORE).sum())


def pad_batch(examples: Sequence[tuple[torch.Tensor, torch.Tensor]], pad: int, width: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples right-padded to `width` positions (None: the longest): inputs with `pad`, labels with IGNORE."""
    width = width or max(len(x) for x, _ in examples)
    inputs = torch.full((len(examples), width), pad, dtype=torch.int64)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.int64)
    for row, (x, y) in enumerate(examples):
        inputs[row, :len(x)], labels[row, :len(y)] = x, y
    return inputs, labels


@dataclass
class PairData:
    train: PairDataset
    val: PairDataset
    tokenizer: Tokenizer
    vocab_size: int  # the tokenizer's, and <sep>, <eos> where the template adds them
    max_new_tokens: int  # what decoding may generate: max_target_len tokens and <eos>
    width: int | None = None  # every batch padded to it where shapes are fixed; None: to its longest example
    test: PairDataset | None = None  # the source's test split, only decoded and scored; None: it has none
    capped: str = ""  # what data.max_chars dropped from the training pairs ("" when none), for messages

    @property
    def eos(self) -> int:
        return self.train.eos

    def collate(self, examples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_batch(examples, self.eos, self.width)

    def text(self, ids: Sequence[int]) -> str:
        """Generated ids as text; <sep> or <eos> inside them (an untrained model emits anything) are dropped, as are
        a folder tokenizer's special tokens."""
        return self.tokenizer.decode([i for i in ids if i < self.tokenizer.vocab_size]).strip()


def load_pairs(cfg: DataConfig, width: int | None = None) -> PairData:
    """The tokenized splits, batched to `width` positions (None: each batch to its longest example). One rank at
    a time gets the tokenizer, so a BPE is trained once and the others load it from the cache; each rank tokenizes
    the pairs itself (seconds, even for IWSLT's 160k pairs)."""
    pairs = read_pairs(cfg)
    tokenizers = cache_dir(cfg) / "tokenizers"
    tokenizers.mkdir(exist_ok=True)
    with FileLock(str(tokenizers / ".lock")):
        both_sides = "\n".join(text for pair in pairs.train for text in pair)
        tokenizer = get_tokenizer(cfg, both_sides, tokenizers)
    added = 2 if tokenizer.eos is None else 0  # <sep> and <eos>, or the tokenizer's own end token
    return PairData(PairDataset(pairs.train, tokenizer, cfg), PairDataset(pairs.val, tokenizer, cfg), tokenizer,
                    tokenizer.vocab_size + added, cfg.max_target_len + 1, width,
                    PairDataset(pairs.test, tokenizer, cfg) if pairs.test is not None else None, pairs.capped)
