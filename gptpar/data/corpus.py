"""Tokenized corpora, cached on disk as memory-mapped token arrays.

Many ranks may start at once on a shared filesystem: a file lock makes exactly one of them
tokenize, the result is written atomically, and the others then map the finished file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from gptpar.atomic import atomic_write
from gptpar.config import DataConfig
from gptpar.data.sources import cache_dir, load_text
from gptpar.data.tokenizer import get_tokenizer

CACHE_FORMAT = 1


@dataclass
class TokenSplits:
    train: np.ndarray  # read-only memory maps of int32 token ids
    val: np.ndarray
    vocab_size: int
    tokenizer: str


def _split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """A deterministic split by position: the last `val_fraction` of the text is held out."""
    cut = int(len(text) * (1 - val_fraction))
    return text[:cut], text[cut:]


def _save_npy(path: Path, tokens: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, tokens.astype(np.int32), allow_pickle=False))


def _synthetic(cfg: DataConfig) -> TokenSplits:
    """Uniform random tokens: no text, no tokenizer, for throughput runs."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=cfg.synthetic_tokens, dtype=np.int32)
    cut = int(len(tokens) * (1 - cfg.val_fraction))
    return TokenSplits(tokens[:cut], tokens[cut:], cfg.vocab_size, "synthetic")


def _cache_key(cfg: DataConfig) -> str:
    identity = {"format": CACHE_FORMAT, "source": cfg.source, "tokenizer": cfg.tokenizer,
                "vocab_size": cfg.vocab_size, "max_chars": cfg.max_chars,
                "val_fraction": cfg.val_fraction}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def load_tokens(cfg: DataConfig) -> TokenSplits:
    """Tokens of the train and validation splits; tokenizes only when no cache exists yet."""
    if cfg.source == "synthetic":
        return _synthetic(cfg)
    cache = cache_dir(cfg) / "tokens" / _cache_key(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / "meta.json"
    with FileLock(str(cache / ".lock")):
        if not meta_path.is_file():
            train_text, val_text = _split_text(load_text(cfg), cfg.val_fraction)
            tokenizer = get_tokenizer(cfg, train_text, cache_dir(cfg) / "tokenizers")
            _save_npy(cache / "train.npy", tokenizer.encode(train_text))
            _save_npy(cache / "val.npy", tokenizer.encode(val_text))
            meta = {"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name, "source": cfg.source}
            atomic_write(meta_path, lambda f: f.write(json.dumps(meta).encode()))  # written last: the commit
    meta = json.loads(meta_path.read_text())
    return TokenSplits(np.load(cache / "train.npy", mmap_mode="r"), np.load(cache / "val.npy", mmap_mode="r"),
                       meta["vocab_size"], meta["tokenizer"])
