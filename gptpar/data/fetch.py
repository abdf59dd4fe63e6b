"""Data before the job: `gptpar data fetch` fills the local Hugging Face cache with a hub dataset (and GPT-2's
tokenizer), or the data folder with an image set (gptpar.data.image_store), on a machine that reaches the hub, a login
node, so that compute nodes without internet train from the cache; and the submit side refuses, before any run folder
is written, a hub dataset (or image set) that is neither cached nor reachable, or a local data file the ranks would
refuse (either would only fail on the rank, after the queue)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from gptpar.config.schema import PAIR_TASKS, DataConfig
from gptpar.data.image_store import hub_name, require_saved, saved_folder, saved_splits
from gptpar.data.pair_files import read_pairs
from gptpar.data.sources import hf_split, load_text, text_paths
from gptpar.data.tokenizer import gpt2_tokenizer
from gptpar.errors import GptparError, require_extra
from gptpar.hub import hub_reachable

HF = "hf:"
LOGIN_CHARS = 2_000_000  # of a corpus, checked on the login side (data.max_chars's default): not a whole corpus


def fetch_hint(spec: str) -> str:
    return f"run `gptpar data fetch {HF}{spec}` where the hub is reachable (a login node), then again here"


def require_hub_data(cfg: DataConfig) -> None:
    """One line, before anything is written, when data.source is a hub dataset this machine can neither reach nor
    find in its cache (datasets' offline lookup, only then: a reachable hub is left to the rank); an image set, when
    it is not in the data folder either."""
    if hub_name(cfg) is not None:
        return require_saved(cfg)
    if not cfg.source.startswith(HF) or hub_reachable(cfg.hub_timeout_s):
        return
    datasets = require_extra("datasets", f"data.source={cfg.source}", "hf")
    name, _, config = cfg.source[len(HF):].partition(":")
    try:
        datasets.load_dataset_builder(name, config or None)  # offline now (hub_reachable forced it): the cache only
    except Exception:
        raise GptparError(f"data.source={cfg.source}: not in this machine's Hugging Face cache and the hub is "
                          f"unreachable; {fetch_hint(cfg.source[len(HF):])}") from None


def check_local_data(cfg: DataConfig) -> None:
    """Read a local data file as the ranks will (pairs: every line; text: what data.max_chars uses, up to
    LOGIN_CHARS), so that data they would refuse (not UTF-8, a line that is not a pair, a split without pairs, ...)
    is one line here, before any run folder is written, as a bad config key is. A hub dataset, and the bundled
    sample, are the rank's to read."""
    local = cfg.source.startswith(("jsonl:", "tsv:")) if cfg.task in PAIR_TASKS else cfg.source.startswith("text:")
    if local:
        stamps = tuple((stat.st_size, stat.st_mtime_ns) for stat in (path.stat() for path in text_paths(cfg.source)))
        _read_as_ranks(cfg, stamps)


@functools.lru_cache(maxsize=16)
def _read_as_ranks(cfg: DataConfig, stamps: tuple[tuple[int, int], ...]) -> None:
    """Remembered by the files' sizes and times (`stamps`), so that a sweep's points read their shared files once."""
    if cfg.task in PAIR_TASKS:
        read_pairs(cfg)
    else:
        load_text(dataclasses.replace(cfg, max_chars=min(cfg.max_chars or LOGIN_CHARS, LOGIN_CHARS)))


def fetch(cfg: DataConfig) -> str:
    """Download data.source's every split (and GPT-2's tokenizer, where data.tokenizer may use it) into the cache;
    what was fetched, for the user. An image set is saved in the data folder (gptpar.data.image_store)."""
    images = hub_name(cfg) is not None
    if not cfg.source.startswith(HF) and not images:
        return f"nothing to fetch: data.source={cfg.source} is read from this machine's files"
    spec = cfg.source[len(HF):]
    if not hub_reachable(cfg.hub_timeout_s):
        raise GptparError(f"data.source={cfg.source}: the Hugging Face hub is unreachable from this machine "
                          f"(within data.hub_timeout_s={cfg.hub_timeout_s:g} s); fetch where it is reachable")
    if images:
        return f"fetched {cfg.source} ({_rows(saved_splits(cfg))}) into {saved_folder(cfg)}"
    rows = _rows(hf_split(spec, dataclasses.replace(cfg, streaming=False), None))  # every split, downloaded whole
    tokenizer = ""
    if cfg.tokenizer in ("auto", "gpt2"):
        tokenizer = " and GPT-2's tokenizer" if gpt2_tokenizer(cfg.hub_timeout_s) is not None else ""
    return f"fetched {cfg.source} ({rows}){tokenizer} into the Hugging Face cache"


def _rows(splits: Any) -> str:
    """`train 50,000 rows, test 10,000 rows`: a DatasetDict's splits, for the user."""
    return ", ".join(f"{split} {len(rows):,} rows" for split, rows in splits.items())
