"""Where training text comes from: each `data.source` resolves to text (or, for synthetic, tokens)."""

from __future__ import annotations

import codecs
import hashlib
import os
import stat
import sysconfig
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from gptpar.config import DataConfig
from gptpar.errors import GptparError, require_extra
from gptpar.hub import hub_reachable
from gptpar.paths import check_path

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSHAKESPEARE_FILE = "tinyshakespeare.txt"
DOWNLOAD_TIMEOUT_S = 10.0


def data_dir(cfg: DataConfig, create: bool = True) -> Path:
    """`data.dir`, else $GPTPAR_DATA_DIR, else ~/.cache/gptpar: shared by every run on the machine. A file where
    the folder would be is a one-line error naming the setting that chose it."""
    setting = "data.dir" if cfg.dir else "GPTPAR_DATA_DIR" if os.environ.get("GPTPAR_DATA_DIR") else "data folder"
    chosen = cfg.dir or os.environ.get("GPTPAR_DATA_DIR") or Path.home() / ".cache" / "gptpar"
    path = check_path(Path(chosen).expanduser(), "folder", setting, "name a folder for data and its caches",
                      must_exist=False)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(cfg: DataConfig) -> Path:
    """Tokenizer and token caches: inside the data directory, unless it is read-only (a shared copy)."""
    base = data_dir(cfg)
    if not os.access(base, os.W_OK):
        base = Path.home() / ".cache" / "gptpar"
    path = base / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path, limit: int = 0) -> str:
    """The sha256 of the file's first `limit` bytes (0: all of it)."""
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(min(1 << 20, limit - done) if limit else 1 << 20):
            digest.update(block)
            done += len(block)
    return digest.hexdigest()


def bytes_used(max_chars: int) -> int:
    """The bytes of a text file that can hold its first `max_chars` characters (UTF-8 spends at most 4 on one, and a
    \r\n read as one newline 2): what is read and hashed of it; 0 (data.max_chars=0) for all."""
    return 4 * max_chars


def _truncate(texts: Iterable[str], max_chars: int) -> str:
    """Join documents (newline-separated) until `max_chars` characters; 0 means everything."""
    parts, total = [], 0
    for text in texts:
        if max_chars and total + len(text) >= max_chars:
            parts.append(text[: max_chars - total])
            break
        parts.append(text)
        total += len(text) + 1
    return "\n".join(parts)


def stdlib_text(max_chars: int) -> str:
    """The interpreter's own standard library: a corpus every machine has, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return _truncate((p.read_text(encoding="utf-8", errors="replace") for p in files), max_chars)


def tinyshakespeare_path(cfg: DataConfig) -> Path:
    """The cached corpus, downloaded and checked once; nothing is fetched when it is present."""
    target = data_dir(cfg) / TINYSHAKESPEARE_FILE
    if target.is_file():
        if sha256_of(target) != TINYSHAKESPEARE_SHA256:
            raise GptparError(f"{target} does not have the expected sha256 {TINYSHAKESPEARE_SHA256}; "
                              "delete it or replace it with the real corpus")
        return target
    partial = target.with_suffix(f".part{os.getpid()}")
    try:
        with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
            partial.write_bytes(response.read())
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise GptparError(
            f"data.source=tinyshakespeare: cannot download {TINYSHAKESPEARE_URL} ({exc.__class__.__name__}); "
            f"copy the file to {target} or point GPTPAR_DATA_DIR (or data.dir) at a folder holding "
            f"{TINYSHAKESPEARE_FILE}") from None
    if sha256_of(partial) != TINYSHAKESPEARE_SHA256:
        partial.unlink()
        raise GptparError(f"downloaded {TINYSHAKESPEARE_URL} but its sha256 does not match; not cached")
    os.replace(partial, target)
    return target


def text_paths(source: str) -> list[Path]:
    """The files named by `KIND:PATH[,PATH...]` (text:, or translation's jsonl: and tsv:), each checked to exist
    and to be named once."""
    kind, _, rest = source.partition(":")
    paths = [p.strip() for p in rest.split(",") if p.strip()]
    if not paths:
        raise GptparError(f"data.source={kind}: names no file (got {source!r}); use {kind}:PATH[,PATH...]")
    files = [check_path(Path(p).expanduser(), "file", f"data.source={kind}:") for p in paths]
    for path in files:
        if not path.is_file():  # it exists (check_path), as a pipe or a device: reading it may never end
            raise GptparError(f"data.source={kind}: {path} is {_special_kind(path)}, not a regular file; save the "
                              "text in a file and name that")
    _refuse_duplicates(kind, files)
    return files


def _special_kind(path: Path) -> str:
    """What a path that exists but is neither a file nor a folder is, in words."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def _refuse_duplicates(kind: str, files: list[Path]) -> None:
    """One file named twice, or two with the same content, would train twice on the same text and validate on text
    it trained on (the held-out tail of one copy, or a validation file that is the training file). Files are the
    same by resolved path, else by sha256 (read only where sizes match; empty files hold nothing to repeat)."""
    named: dict[Path, Path] = {}
    for path in files:
        first = named.setdefault(path.resolve(), path)
        if first is not path:
            spelled = f" (as {first} and {path})" if first != path else ""
            raise GptparError(f"data.source={kind}: names {path.resolve()} twice{spelled}; list each file once")
    digests: dict[tuple[int, str], Path] = {}
    sizes = [path.stat().st_size for path in files]
    for path, size in zip(files, sizes, strict=True):
        if size and sizes.count(size) > 1:
            first = digests.setdefault((size, sha256_of(path)), path)
            if first is not path:
                raise GptparError(f"data.source={kind}: {first} and {path} have the same content; list it once "
                                  "(a copy trains twice, and validates on text it trained on)")


def read_text_file(path: Path, kind: str = "text", max_chars: int = 0) -> str:
    """One document: the file as UTF-8 text (at least its first `max_chars` characters, 0: all), with universal
    newlines; anything else is refused."""
    limit = bytes_used(max_chars)
    with open(path, "rb") as f:
        data = f.read(limit) if limit else f.read()
    try:  # a character that the limit cut in two is left out, not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not limit or len(data) < limit)
    except UnicodeDecodeError as exc:
        raise GptparError(f"data.source={kind}: {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                          f"offset {exc.start}); convert it, e.g. iconv -f latin1 -t utf-8") from None
    if "\x00" in text:
        raise GptparError(f"data.source={kind}: {path} is not UTF-8 text (a NUL byte at offset "
                          f"{data.index(0)}: a binary file?)")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def text_files(paths: list[Path], max_chars: int) -> str:
    """Local text files, each one document."""
    return _truncate((read_text_file(p, max_chars=max_chars) for p in paths), max_chars)


def hf_split(spec: str, cfg: DataConfig, split: str | None):
    """One split of a hub dataset (`datasets.Dataset`, or an iterable one with `data.streaming`); split None: every
    split the dataset has, by name (what an optional split is looked up in). The hub is probed first, so an offline
    machine uses the local cache and fails in one line instead of retrying."""
    datasets = require_extra("datasets", f"data.source=hf:{spec}", "hf")
    name, _, config = spec.partition(":")
    reachable = hub_reachable(cfg.hub_timeout_s)
    try:
        return datasets.load_dataset(name, config or None, split=split, streaming=cfg.streaming)
    except Exception as exc:
        where = "reachable" if reachable else "unreachable (and the dataset is not in the local cache)"
        raise GptparError(f"data.source=hf:{spec}: cannot load the dataset; the Hugging Face hub is "
                          f"{where}: {str(exc).splitlines()[0][:200]}") from None


def hf_text(spec: str, cfg: DataConfig) -> str:
    """A hub dataset's `text` column; with `data.streaming` only the needed rows are read."""
    ds = hf_split(spec, cfg, "train")
    if "text" not in (ds.column_names or []):
        raise GptparError(f"data.source=hf:{spec}: the dataset has no 'text' column "
                          f"(columns: {ds.column_names})")
    return _truncate((row["text"] for row in ds), cfg.max_chars)


def load_text(cfg: DataConfig) -> str:
    source = cfg.source
    if source == "stdlib":
        return stdlib_text(cfg.max_chars)
    if source == "tinyshakespeare":
        return _truncate([tinyshakespeare_path(cfg).read_text(encoding="utf-8")], cfg.max_chars)
    if source.startswith("text:"):
        return text_files(text_paths(source), cfg.max_chars)
    if source.startswith("hf:"):
        return hf_text(source[3:], cfg)
    raise GptparError(f"data.source: {source!r} is not allowed; use stdlib, tinyshakespeare, synthetic, "
                      "text:PATH[,PATH...] or hf:NAME[:CONFIG]")
