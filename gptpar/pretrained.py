"""A pretrained model folder (`model.init=pretrained:PATH`): what transformers' `save_pretrained` writes, read here
without torch, so the config checks, the planner's counts and the submit side see the folder's shape before any rank
loads its weights. Compute nodes have no internet: the folder is fetched once on a login node (README), and nothing
here or in the loader downloads.

A folder holds `config.json` (its `model_type` names the architecture), its weights (`model.safetensors`, or shards
with their index, or PyTorch's `pytorch_model.bin`) and its tokenizer (`tokenizer.json`, with `tokenizer_config.json`
or `chat_template.jinja` holding its chat template), which `data.tokenizer` then reads (gptpar.data.tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gptpar.architectures import ARCHS
from gptpar.errors import ConfigError
from gptpar.presets import ModelShape

PREFIX = "pretrained:"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def folder_of(setting: str) -> Path | None:
    """The folder a `pretrained:PATH` setting names (model.init, data.tokenizer); None for any other value."""
    return Path(setting[len(PREFIX):]).expanduser() if setting.startswith(PREFIX) else None


def check_named(setting: str, key: str) -> None:
    """`pretrained:` with no path would quietly read the current folder: a setting must name its folder."""
    if setting == PREFIX:
        raise ConfigError(f"{key}={PREFIX} names no folder; use {PREFIX}PATH (a folder written by transformers' "
                          "save_pretrained)")


def _require_folder(folder: Path, key: str, hint: str = "") -> None:
    """`folder` must be a folder: a file, or nothing, at that path fails in one line naming `key`."""
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "no such folder"
        raise ConfigError(f"{key}={PREFIX}{folder}: {what}{hint}")


def folder_config(folder: Path, key: str = "model.init") -> dict:
    """The folder's config.json; a missing folder or file, or one that is not JSON, fails in one line naming `key`."""
    path = folder / "config.json"
    _require_folder(folder, key, "; name a folder written by transformers' save_pretrained (see docs/models.md: fetch "
                    "it once on a login node)")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}={PREFIX}{folder}: the folder has no config.json; name a folder written by "
                          "transformers' save_pretrained") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{key}={PREFIX}{folder}: config.json cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}={PREFIX}{folder}: config.json is not a JSON object")
    return config


def folder_shape(folder: Path) -> ModelShape:
    """The model shape the folder's config.json describes (its weights fix every size); an architecture gptpar
    does not describe fails naming the ones it does."""
    config = folder_config(folder)
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise ConfigError(f"model.init={PREFIX}{folder}: config.json describes a {arch!r} model; gptpar trains "
                          f"{', '.join(ARCHS)}")
    try:
        if arch == "vit":
            return ModelShape("vit", config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
                              (config["image_size"] // config["patch_size"]) ** 2 + 1,
                              n_inner=config["intermediate_size"], tied=False, image_size=config["image_size"],
                              patch_size=config["patch_size"])
        if arch == "gpt2":
            return ModelShape("gpt2", config["n_layer"], config["n_embd"], config["n_head"], config["n_positions"],
                              n_inner=config.get("n_inner") or 0)
        rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
        top_k = config.get("num_experts_per_tok", 0)
        experts = {"mixtral": dict(n_experts=config.get("num_local_experts", 0), top_k=top_k),
                   "qwen2_moe": dict(n_experts=config.get("num_experts", 0), top_k=top_k,
                                     shared_inner=config.get("shared_expert_intermediate_size", 0))}.get(arch, {})
        inner = config["moe_intermediate_size"] if arch == "qwen2_moe" else config["intermediate_size"]
        return ModelShape(arch, config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
                          config["max_position_embeddings"],
                          n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
                          n_inner=inner, tied=bool(config.get("tie_word_embeddings", False)),
                          rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))), **experts)
    except KeyError as exc:
        raise ConfigError(f"model.init={PREFIX}{folder}: config.json lacks {exc.args[0]!r}, which a {arch} "
                          "model's config has") from None


def check_weights(folder: Path) -> None:
    """The folder must hold weights: a config alone would train a model that is not the one named."""
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"model.init={PREFIX}{folder}: the folder has no weights (one of {', '.join(WEIGHT_FILES)});"
                          " save the model there with save_pretrained, or use model.init=random")


def check_tokenizer(folder: Path, key: str) -> None:
    """A tokenizer setting naming a folder must find the tokenizer there."""
    _require_folder(folder, key)
    if not (folder / TOKENIZER_FILES[0]).is_file():
        raise ConfigError(f"{key}={PREFIX}{folder}: the folder has no {TOKENIZER_FILES[0]} (a fast tokenizer, as "
                          "save_pretrained writes it); save the tokenizer there too")


def tokenizer_digest(folder: Path) -> str:
    """A hash of the folder's tokenizer files, so caches of text it encoded follow its content, not its path."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:16]
