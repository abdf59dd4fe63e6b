"""Named image-classification sets on disk: data.source=cifar100, food101, or hf:NAME[:CONFIG] with
data.task=classify. Torch-free, for the submit side and `gptpar data fetch`; gptpar.data.image_sets reads the items.

A set is fetched once from the hub (`gptpar data fetch`, or the first run on a machine that reaches the hub) and kept
in the data folder as `datasets`' own save_to_disk layout, read back with load_from_disk and no network:

    <data folder>/images/<NAME with / as -->[--<CONFIG>]/   e.g. images/uoft-cs--cifar100/
        dataset_dict.json, train/, test/ (or validation/): one arrow folder per split, the images' bytes inside

A folder of that layout built any other way (DatasetDict.save_to_disk) is read the same. What a set must hold: a train
split and a validation one (validation, valid, val or test: CIFAR-100's test, Food-101's validation), an Image column
(img or image first, else the only one) and a ClassLabel column whose names are the classes (fine_label or label first:
CIFAR-100's 100 fine classes, not its 20 coarse ones).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from filelock import FileLock

from gptpar.atomic import write_error
from gptpar.config import DataConfig
from gptpar.data.sources import data_dir
from gptpar.errors import GptparError, first_sentence, require_extra
from gptpar.hub import hub_reachable

NAMED = {"cifar100": "uoft-cs/cifar100", "food101": "ethz/food101"}  # data.source -> the hub's NAME
NAMED_CLASSES = {"cifar100": 100, "food101": 101}  # their label columns' (CIFAR-100's fine labels)
IMAGE_COLUMNS = ("img", "image")
LABEL_COLUMNS = ("fine_label", "label")
VAL_SPLITS = ("validation", "valid", "val", "test")


def hub_name(cfg: DataConfig) -> str | None:
    """The hub's NAME[:CONFIG] of the image set data.source names; None when it names none."""
    if cfg.source in NAMED:
        return NAMED[cfg.source]
    if cfg.task == "classify" and cfg.source.startswith("hf:"):
        return cfg.source[len("hf:"):]
    return None


def saved_folder(cfg: DataConfig) -> Path:
    """Where the set is kept in the data folder (the module docstring's layout)."""
    return data_dir(cfg) / "images" / str(hub_name(cfg)).replace("/", "--").replace(":", "--")


def fetch_command(cfg: DataConfig) -> str:
    """The words that fetch this set (hf: names a text set unless data.task says otherwise)."""
    return f"gptpar data fetch {cfg.source}" + (" data.task=classify" if cfg.source.startswith("hf:") else "")


def require_saved(cfg: DataConfig) -> None:
    """One line, at once, when the set is neither in the data folder nor fetchable (the hub unreachable): nothing
    is downloaded or waited for."""
    folder = saved_folder(cfg)
    if not folder.is_dir() and not hub_reachable(cfg.hub_timeout_s):
        raise GptparError(f"data.source={cfg.source}: not in {folder} and the Hugging Face hub is unreachable; run "
                          f"`{fetch_command(cfg)}` where the hub is reachable (a login node), then again here")


def saved_splits(cfg: DataConfig) -> Any:
    """The saved DatasetDict, downloaded and saved first (by one process of the many that may start at once) where
    it is missing and the hub is reachable."""
    require_saved(cfg)
    folder = saved_folder(cfg)
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.with_name(folder.name + ".lock"))):
            if not folder.is_dir():
                download(cfg, folder)
    return read_saved(cfg, folder)


def download(cfg: DataConfig, folder: Path) -> None:
    """load_dataset's every split, saved to `folder` through a staging folder renamed when complete; load_dataset's
    own arrow cache goes to the staging folder too (a second copy of the set would otherwise stay in the user's
    Hugging Face cache). A set without an image or a label column is refused before anything is saved."""
    datasets = require_extra("datasets", f"data.source={cfg.source}", "hf")
    name, _, config = str(hub_name(cfg)).partition(":")
    staging = folder.with_name(f".{folder.name}.part{os.getpid()}")
    try:
        try:
            splits = datasets.load_dataset(name, config or None, cache_dir=str(staging / "cache"))
        except Exception as exc:
            raise GptparError(f"data.source={cfg.source}: cannot load {name} from the hub: "
                              f"{first_sentence(exc)[:200]}") from None
        split_names(cfg, splits)
        columns(cfg, splits["train"].features)
        try:
            splits.save_to_disk(str(staging / "set"))
            os.replace(staging / "set", folder)
        except OSError as exc:  # a full disk above all: Food-101 is 5 GB
            raise write_error(folder, exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_saved(cfg: DataConfig, folder: Path) -> Any:
    """The DatasetDict saved in `folder`; a folder that is not one is one line saying how to replace it."""
    datasets = require_extra("datasets", f"data.source={cfg.source}", "hf")
    again = f"delete it and run `{fetch_command(cfg)}`"
    try:
        splits = datasets.load_from_disk(str(folder))
    except Exception as exc:
        raise GptparError(f"data.source={cfg.source}: {folder} is not a saved dataset ({first_sentence(exc)}); "
                          f"{again}") from None
    if not isinstance(splits, datasets.DatasetDict):
        raise GptparError(f"data.source={cfg.source}: {folder} holds one split, not a train and a validation split; "
                          f"{again}")
    return splits


def split_names(cfg: DataConfig, splits: Any) -> tuple[str, str]:
    """The train split's name and the validation split's (the set's own, never a share of train), which must hold
    the same columns and classes."""
    val = next((name for name in VAL_SPLITS if name in splits), None)
    if "train" not in splits or val is None:
        raise GptparError(f"data.source={cfg.source}: the dataset needs a train split and a validation one "
                          f"({', '.join(VAL_SPLITS)}); it has {', '.join(splits) or 'none'}")
    if splits[val].features != splits["train"].features:
        raise GptparError(f"data.source={cfg.source}: the {val} split's columns or classes differ from the train "
                          f"split's ({', '.join(splits[val].features)} against {', '.join(splits['train'].features)})")
    return "train", val


def columns(cfg: DataConfig, features: Any) -> tuple[str, str]:
    """The image column and the label column of `datasets` features, by feature type, the usual names first."""
    return _chosen_columns(cfg, {name: type(feature).__name__ for name, feature in features.items()})


def _chosen_columns(cfg: DataConfig, kinds: dict[str, str]) -> tuple[str, str]:
    """`columns` over each column's feature type by name (datasets' class, or `_type` in a saved set's info)."""
    wanted = (("image", "Image", IMAGE_COLUMNS, "an Image feature"),
              ("label", "ClassLabel", LABEL_COLUMNS, "a ClassLabel feature, whose names are the classes"))
    found = []
    for what, kind, usual, described in wanted:
        typed = [name for name, named in kinds.items() if named == kind]
        chosen = [name for name in usual if name in typed] or (typed if len(typed) == 1 else [])
        if not chosen:
            raise GptparError(
                f"data.source={cfg.source}: the dataset has no {what} column ({described}; {' or '.join(usual)} "
                "first where there are several); its columns: "
                + ", ".join(f"{name} ({named})" for name, named in kinds.items()))
        found.append(chosen[0])
    return found[0], found[1]


def image_classes(cfg: DataConfig) -> int:
    """The classes an image set has, without torch or `datasets` (the planner's, on a login node): the synthetic set's
    data.synthetic_classes, else the label column's names in the saved set's train split (`dataset_info.json`, which
    save_to_disk writes), else the named set's well-known count; a hub set not yet saved is one line naming the fetch
    command."""
    if cfg.source == "synthetic":
        return cfg.synthetic_classes
    info = saved_folder(cfg) / "train" / "dataset_info.json"
    if info.is_file():
        try:
            features = json.loads(info.read_text())["features"]
            label = _chosen_columns(cfg, {name: f.get("_type", "") for name, f in features.items()})[1]
            return len(features[label]["names"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise GptparError(f"data.source={cfg.source}: {info} does not list the classes ({first_sentence(exc)}); "
                              f"delete {saved_folder(cfg)} and run `{fetch_command(cfg)}`") from None
    if cfg.source in NAMED_CLASSES:
        return NAMED_CLASSES[cfg.source]
    raise GptparError(f"data.source={cfg.source}: its classes are read from the saved set, not in {saved_folder(cfg)} "
                      f"yet; run `{fetch_command(cfg)}` where the hub is reachable (a login node)")
