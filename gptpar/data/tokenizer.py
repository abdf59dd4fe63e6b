"""Tokenizers: GPT-2's BPE from the hub when it can be had, else one trained here, raw bytes, or the tokenizer of a
save_pretrained folder (data.tokenizer=pretrained:PATH, which model.init=pretrained:PATH implies) with its own end
token and chat template."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from gptpar.atomic import atomic_write_text
from gptpar.config import DataConfig
from gptpar.errors import GptparError
from gptpar.hub import hub_reachable
from gptpar.pretrained import folder_of, tokenizer_digest


class EachEncoder(Protocol):
    def __call__(self, texts: list[str]) -> list[np.ndarray]: ...


class Decoder(Protocol):
    def __call__(self, ids: Sequence[int]) -> str: ...


class ChatRenderer(Protocol):
    """A conversation as the chat template writes it; with `generation_prompt`, ready for the assistant's turn."""

    def __call__(self, messages: list[dict[str, str]], generation_prompt: bool) -> str: ...


@dataclass
class Tokenizer:
    name: str  # identifies the vocabulary in cache keys
    vocab_size: int
    encode_each: EachEncoder  # one int32 array per text: translation keeps its sentences apart
    decode: Decoder  # ids below vocab_size back to text (BLEU scores detokenized output), without special tokens
    eos: int | None = None  # its own end token (a folder's); None: the pair tasks add <sep> and <eos> past the vocab
    chat: ChatRenderer | None = None  # a folder's chat template, when it has one

    def encode(self, text: str) -> np.ndarray:
        """A corpus, encoded by lines: the Rust tokenizer parallelises a batch and never sees a huge string."""
        pieces = self.encode_each(text.splitlines(keepends=True))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def bytes_tokenizer() -> Tokenizer:
    def encode_each(texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]

    def decode(ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")
    return Tokenizer("bytes", 256, encode_each, decode)


def _from_hf_tokenizer(name: str, hf_tokenizer, eos: int | None = None, chat: ChatRenderer | None = None
                       ) -> Tokenizer:
    """A `tokenizers` tokenizer; no special tokens are added to text (a Llama tokenizer's BOS on every line)."""
    def encode_each(texts: list[str]) -> list[np.ndarray]:
        encodings = hf_tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        return [np.asarray(enc.ids, dtype=np.int32) for enc in encodings]

    def decode(ids: Sequence[int]) -> str:
        return hf_tokenizer.decode(list(ids))
    return Tokenizer(name, hf_tokenizer.get_vocab_size(), encode_each, decode, eos, chat)


def pretrained_tokenizer(folder: Path) -> Tokenizer:
    """A save_pretrained folder's tokenizer (read with transformers, never downloaded), named by its files' hash so
    caches follow its content; its end token must be set, since the pair tasks end every response with it."""
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise GptparError(f"data.tokenizer=pretrained:{folder}: the tokenizer cannot be loaded "
                          f"({str(exc).splitlines()[0]})") from None
    if hf.eos_token_id is None:
        raise GptparError(f"data.tokenizer=pretrained:{folder}: the tokenizer has no end token (eos_token in "
                          "tokenizer_config.json), which ends every response; set one")
    chat = None
    if hf.chat_template:
        def chat(messages: list[dict[str, str]], generation_prompt: bool) -> str:
            return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return _from_hf_tokenizer(f"pretrained-{tokenizer_digest(folder)}", hf.backend_tokenizer, hf.eos_token_id, chat)


def gpt2_tokenizer(timeout_s: float) -> Tokenizer | None:
    """GPT-2's own BPE from the local cache, else from the hub; None when neither has it. The cache comes
    first, so a compute node without internet whose submission fetched the tokenizer never probes."""
    from huggingface_hub import hf_hub_download
    from tokenizers import Tokenizer as HFTokenizer

    for local_only in (True, False):
        if not local_only and not hub_reachable(timeout_s):
            return None
        try:
            path = hf_hub_download("gpt2", "tokenizer.json", local_files_only=local_only)
            return _from_hf_tokenizer("gpt2", HFTokenizer.from_file(path))
        except Exception:
            continue
    return None


def trained_bpe(train_text: str, vocab_size: int, cache_dir: Path) -> Tokenizer:
    """A byte-level BPE trained on the training split, cached by corpus hash and vocabulary size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    digest = hashlib.sha256(train_text.encode("utf-8", errors="replace")).hexdigest()[:16]
    path = cache_dir / f"bpe-{digest}-{vocab_size}.json"
    if path.is_file():
        return _from_hf_tokenizer(f"bpe-{digest}-{vocab_size}", HFTokenizer.from_file(str(path)))
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_text.splitlines(keepends=True), trainer=trainer)
    atomic_write_text(path, tok.to_str())
    return _from_hf_tokenizer(f"bpe-{digest}-{vocab_size}", tok)


def get_tokenizer(cfg: DataConfig, train_text: str, cache_dir: Path) -> Tokenizer:
    if (folder := folder_of(cfg.tokenizer)) is not None:
        return pretrained_tokenizer(folder)
    if cfg.tokenizer == "bytes":
        return bytes_tokenizer()
    if cfg.tokenizer in ("auto", "gpt2"):
        tok = gpt2_tokenizer(cfg.hub_timeout_s)
        if tok is not None:
            return tok
        if cfg.tokenizer == "gpt2":
            raise GptparError("data.tokenizer=gpt2: GPT-2's tokenizer is neither reachable on the hub nor "
                              "cached (HF_HOME); use data.tokenizer=bpe or bytes")
    return trained_bpe(train_text, cfg.vocab_size, cache_dir)


def resolve_tokenizer_choice(cfg: DataConfig) -> str:
    """`auto` made concrete once, at submission: gpt2 when GPT-2's tokenizer can be had (it is then in
    the local cache for the job), else bpe. Recorded in the run's config, so every rank, restart and
    sweep point of a submission uses the same vocabulary."""
    if cfg.tokenizer != "auto" or cfg.source == "synthetic":
        return cfg.tokenizer
    return "gpt2" if gpt2_tokenizer(cfg.hub_timeout_s) is not None else "bpe"
