"""Tokenized corpora, cached on disk as memory-mapped token arrays.

Many ranks may start at once on a shared filesystem: a file lock makes exactly one of them
tokenize, the result is written atomically, and the others then map the finished file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from gptpar.atomic import atomic_write
from gptpar.config import DataConfig
from gptpar.data.sources import TINYSHAKESPEARE_SHA256, bytes_used, cache_dir, load_text, sha256_of, text_paths
from gptpar.data.tokenizer import get_tokenizer
from gptpar.errors import GptparError

CACHE_FORMAT = 2  # 2: keyed on the content of the source, not only its name


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


def _content(cfg: DataConfig) -> object:
    """What the source's text is, as far as it can be told before reading it.

    A `text:` file counts by size, mtime and the sha256 of the bytes data.max_chars can use, so an edit (even one
    that keeps the size and the mtime) retokenizes, and a huge file is not read to its end; tinyshakespeare is
    checked against a fixed sha256; the stdlib corpus is the interpreter's own. hf: datasets are named only (their
    revision is not known before loading).
    """
    if cfg.source == "stdlib":
        return {"python": sys.version}
    if cfg.source == "tinyshakespeare":
        return {"sha256": TINYSHAKESPEARE_SHA256}
    if cfg.source.startswith("text:"):
        files = []
        for path in text_paths(cfg.source):
            stat = path.stat()
            files.append({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                          "sha256": sha256_of(path, bytes_used(cfg.max_chars))})
        return files
    return None


def _cache_key(cfg: DataConfig) -> str:
    identity = {"format": CACHE_FORMAT, "source": cfg.source, "content": _content(cfg),
                "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size, "max_chars": cfg.max_chars,
                "val_fraction": cfg.val_fraction}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _read_cache(cache: Path) -> TokenSplits | None:
    """The cached splits, or None when any part is missing or unreadable (then they are rebuilt)."""
    try:
        meta = json.loads((cache / "meta.json").read_text())
        return TokenSplits(np.load(cache / "train.npy", mmap_mode="r"), np.load(cache / "val.npy", mmap_mode="r"),
                           meta["vocab_size"], meta["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_tokens(cfg: DataConfig) -> TokenSplits:
    """Tokens of the train and validation splits; tokenizes only when no complete cache exists yet."""
    if cfg.source == "synthetic":
        return _synthetic(cfg)
    cache = cache_dir(cfg) / "tokens" / _cache_key(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / "meta.json"
    with FileLock(str(cache / ".lock")):
        splits = _read_cache(cache)
        if splits is None:  # never built, or a file deleted or damaged under its metadata
            meta_path.unlink(missing_ok=True)
            train_text, val_text = _split_text(load_text(cfg), cfg.val_fraction)
            tokenizer = get_tokenizer(cfg, train_text, cache_dir(cfg) / "tokenizers")
            _save_npy(cache / "train.npy", tokenizer.encode(train_text))
            _save_npy(cache / "val.npy", tokenizer.encode(val_text))
            meta = {"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name, "source": cfg.source}
            atomic_write(meta_path, lambda f: f.write(json.dumps(meta).encode()))  # written last: the commit
            splits = _read_cache(cache)
    if splits is None:
        raise GptparError(f"the token cache {cache} cannot be read back after writing it; delete the folder "
                          "and run again")
    return splits
