"""Prompt/response pairs read from their source, without torch: the submit side reads a local file before a run
folder exists (bad data is one line there, as a bad config key is), and each rank reads it the same way before
gptpar.data.pairs tokenizes it. Sources and splits: see gptpar.data.pairs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptpar.config import SFT_SAMPLE, DataConfig
from gptpar.data.sources import hf_split, read_text_file, text_paths
from gptpar.errors import GptparError

SOURCE_LANG, TARGET_LANG = "de", "en"
SAMPLES = Path(__file__).parent / "samples"
Pair = tuple[str, str]


def pair_fields(cfg: DataConfig) -> tuple[str, str]:
    """The (prompt, response) fields of a row for the task."""
    return (cfg.prompt_field, cfg.response_field) if cfg.task == "sft" else (SOURCE_LANG, TARGET_LANG)


def row_pair(row: Any, where: str, fields: tuple[str, str] = (SOURCE_LANG, TARGET_LANG)) -> Pair:
    """The two `fields` of a row (translation's may nest them under "translation"); `where` names it in the error."""
    translation = fields == (SOURCE_LANG, TARGET_LANG)
    inner = (row.get("translation", row) if translation else row) if isinstance(row, dict) else None
    pair = tuple(inner.get(field) for field in fields) if isinstance(inner, dict) else ()
    if len(pair) != 2 or not all(isinstance(text, str) for text in pair):
        nested = " (or {\"translation\": {...}})" if translation else ""
        missing = [f for f in fields if not isinstance(inner, dict) or not isinstance(inner.get(f), str)]
        raise GptparError(f"{where}: expected an object with {fields[0]!r} and {fields[1]!r} strings{nested}, "
                          f"{missing[0]!r} is missing or not a string; got {str(row)[:80]}")
    return pair


def _file_pairs(kind: str, path: Path, fields: tuple[str, str]) -> list[Pair]:
    """The pairs of one jsonl or tsv file; blank lines are skipped, a bad line fails naming file and line."""
    pairs = []
    for number, line in enumerate(read_text_file(path, kind).split("\n"), 1):
        if not line.strip():
            continue
        where = f"data.source={kind}: {path}:{number}"
        if kind == "tsv":
            fields = line.split("\t")
            if len(fields) != 2:
                raise GptparError(f"{where}: expected {SOURCE_LANG}<TAB>{TARGET_LANG}, got {len(fields)} field(s)")
            pairs.append((fields[0], fields[1]))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GptparError(f"{where}: not valid JSON ({exc.msg})") from None
        pairs.append(row_pair(row, where, fields))
    return pairs


def _capped(pairs: Iterable[Pair], max_chars: int, offered: int | None) -> tuple[list[Pair], str]:
    """Pairs until their characters (both sides) reach `max_chars` (0 keeps all), and what the cap dropped of the
    `offered` pairs (None: not counted, a streamed split) in words naming the key; "" when it dropped none."""
    kept, total = [], 0
    for pair in pairs:
        if max_chars and total >= max_chars:
            of, dropped = ("", "the rest") if offered is None else (f" of {offered}", offered - len(kept))
            return kept, f"data.max_chars={max_chars} kept {len(kept)}{of} training pairs (dropped {dropped})"
        kept.append(pair)
        total += len(pair[0]) + len(pair[1])
    return kept, ""


def _hub_pairs(source: str, rows: Iterable[Any], split: str, fields: tuple[str, str]) -> Iterator[Pair]:
    """One hub split's rows as pairs; a bad row's error names the split."""
    return (row_pair(row, f"data.source={source} ({split})", fields) for row in rows)


@dataclass(frozen=True)
class PairSplits:
    """The pairs of `data.source`, split; no split is empty."""

    train: list[Pair]
    val: list[Pair]
    test: list[Pair] | None  # None: the source has no test split
    capped: str = ""  # what data.max_chars dropped from the training pairs ("" when none), for messages


def read_pairs(cfg: DataConfig) -> PairSplits:
    """The train, validation and test pairs of `data.source`; a split without pairs fails, naming its file or the
    key that emptied it."""
    source, fields = cfg.source, pair_fields(cfg)
    if source == SFT_SAMPLE:
        source = f"jsonl:{SAMPLES / 'metamath_sample.ndjson'}"  # JSON lines
    if source.startswith("hf:"):
        splits = hf_split(source[3:], cfg, None)  # every split: whether there is a test split is the dataset's
        needed = ("train",) if cfg.task == "sft" else ("train", "validation")
        missing = [split for split in needed if split not in splits]
        if missing:
            raise GptparError(f"data.source={source}: the dataset has no {missing[0]!r} split "
                              f"(it has {', '.join(splits) or 'none'})")
        rows = splits["train"]
        offered = len(rows) if isinstance(rows, Sized) else None
        train_pairs: Iterable[Pair] = _hub_pairs(source, rows, "train", fields)
        if "validation" in splits:
            val = list(_hub_pairs(source, splits["validation"], "validation", fields))
        else:  # sft: held out from the train split, as one file's pairs are
            train_pairs, val = _held_out(list(train_pairs), cfg.val_fraction, "a dataset with a validation split",
                                         source)
            offered = len(train_pairs)
        train, capped = _capped(train_pairs, cfg.max_chars, offered)
        _check_responses(train, f"data.source={source}", fields[1])
        named = {"train": train, "validation": val,
                 "test": list(_hub_pairs(source, splits["test"], "test", fields)) if "test" in splits else None}
        empty = [split for split, pairs in named.items() if pairs == []]
        if empty:
            raise GptparError(f"data.source={source}: the dataset's {empty[0]!r} split has no pairs")
        return PairSplits(*named.values(), capped)
    kind = source.partition(":")[0]
    paths = text_paths(source)
    if len(paths) > 3:
        raise GptparError(f"data.source={kind}: names {len(paths)} files; use {kind}:TRAIN, {kind}:TRAIN,VALID or "
                          f"{kind}:TRAIN,VALID,TEST")
    files = [_file_pairs(kind, path, fields) for path in paths]
    empty = [path for path, pairs in zip(paths, files, strict=True) if not pairs]
    if empty:
        raise GptparError(f"data.source={kind}: {empty[0]} has no pairs; add some or name another file")
    if len(paths) == 1:
        files = _held_out(files[0], cfg.val_fraction, f"{kind}:TRAIN,VALID", paths[0])
    train, capped = _capped(files[0], cfg.max_chars, len(files[0]))
    _check_responses(train, f"data.source={kind}: {paths[0]}", fields[1])
    return PairSplits(train, files[1], files[2] if len(files) == 3 else None, capped)


def _check_responses(train: list[Pair], where: str, field: str) -> None:
    """The loss is on the responses: with every one empty a run would train on the end token alone, silently."""
    if not any(response.strip() for _, response in train):
        raise GptparError(f"{where}: every training pair's response ({field!r}) is empty, and the loss is on the "
                          "responses; fill them in, or name the field that holds them (data.response_field for sft)")


def _held_out(pairs: list[Pair], val_fraction: float, two_files: str, path: str | Path) -> list[list[Pair]]:
    """One file's pairs as [train, validation]: the last `val_fraction` of them is held out; both must have pairs."""
    cut = int(len(pairs) * (1 - val_fraction))
    if cut == len(pairs):
        raise GptparError(f"data.val_fraction={val_fraction:g} holds out none of the {len(pairs)} pairs of {path} "
                          f"for validation; raise data.val_fraction or name a validation file ({two_files})")
    if cut == 0:
        raise GptparError(f"data.val_fraction={val_fraction:g} leaves none of the {len(pairs)} pair(s) of {path} "
                          f"for training; add pairs or name a validation file ({two_files})")
    return [pairs[:cut], pairs[cut:]]
