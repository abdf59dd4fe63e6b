"""The config as text and back: YAML files (strict: no base-60 numbers, no duplicate keys), `section.key=value`
overrides, layers of values with their origins, typed coercion with one-line errors, and the YAML a run folder
keeps."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from gptpar.config.checks import validate
from gptpar.config.schema import SECTIONS, Config
from gptpar.errors import ConfigError
from gptpar.paths import path_problem
from gptpar.pretrained import folder_of

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _shown(value: Any, limit: int = 40) -> str:
    """A value as an error message quotes it: its repr, shortened so the message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _allowed(meta: typing.Mapping[str, Any], kind: str) -> str:
    """What a numeric field accepts, e.g. 'a finite number >= 0.0 and <= 1.0'."""
    bounds = [f"{op} {meta[k]}" for op, k in ((">=", "min"), ("<=", "max")) if meta.get(k) is not None]
    return " and ".join([f"{kind} {bounds[0]}", *bounds[1:]]) if bounds else kind


def _coerce(key: str, value: Any, f: dataclasses.Field, hint: Any) -> Any:
    """Convert a YAML or command-line value to the field's type and check its constraints."""
    meta = f.metadata
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
    elif hint is int:
        if isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {_shown(value)}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_shown(value)}")
        if not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(f"{key}: {_shown(value)} does not fit in a 64-bit integer; "
                              f"expected {_allowed(meta, 'an integer')}")
    elif hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {_shown(value)}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {_shown(value)}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond a float's range
            raise ConfigError(f"{key}: {_shown(value)} is not finite as a number; "
                              f"expected {_allowed(meta, 'a finite number')}") from None
        # NaN compares false with everything, so it would pass every range check below.
        if math.isnan(value):
            raise ConfigError(f"{key}: nan is not a number; expected {_allowed(meta, 'a finite number')}")
        if math.isinf(value):
            raise ConfigError(f"{key}: {value} is not finite; expected {_allowed(meta, 'a finite number')}")
    elif hint is str:
        if value is None:
            value = ""
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        # YAML reads true/false as booleans: a key that was a boolean once (train.compile) still loads.
        value = str(value).lower() if isinstance(value, bool) else str(value)
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of: {', '.join(meta['choices'])}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{key}: {value!r} is below the minimum {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{key}: {value!r} is above the maximum {meta['max']}")
    return value


@functools.cache
def _type_hints(section: type) -> dict[str, Any]:
    """A section's field types, resolved once (resolving them is most of a key's cost, and the planner's search sets
    thousands)."""
    return typing.get_type_hints(section)


def _set(cfg: Config, dotted: str, value: Any) -> Config:
    """A copy of cfg with one key changed (configs are frozen: a resolved config is never mutated)."""
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS:
        raise ConfigError(f"unknown section {section_name!r} in {dotted!r}; sections: {', '.join(SECTIONS)}")
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"unknown key {dotted!r}; {section_name} keys: {', '.join(fields)}")
    hint = _type_hints(type(section))[key]
    changed = dataclasses.replace(section, **{key: _coerce(dotted, value, fields[key], hint)})
    return dataclasses.replace(cfg, **{section_name: changed})


def apply_dict(cfg: Config, data: Any, origin: str = "config") -> Config:
    """A copy of cfg with a {section: {key: value}} mapping applied (not yet validated as a whole)."""
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(data).__name__}")
    for section_name, values in data.items():
        if section_name not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section {section_name!r}; sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: section {section_name!r} must be a mapping of keys")
        for key, value in values.items():
            cfg = _set(cfg, f"{section_name}.{key}", value)
    return cfg


def updated(cfg: Config, changes: dict[str, Any]) -> Config:
    """A validated copy of cfg with `section.key` values changed: how the submit and rank sides
    resolve a config (job shape, run folder, world size) without mutating the one they were given."""
    for dotted, value in changes.items():
        cfg = _set(cfg, dotted, value)
    validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, str]:
    """Split `section.key=value`; the value stays text and is converted by the field's type."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, value = text.split("=", 1)
    return key.strip(), value


class DuplicateKey(yaml.MarkedYAMLError):
    """A key given twice in one mapping: PyYAML would silently keep the last value."""


class _Loader(yaml.SafeLoader):
    """YAML without base-60 numbers, so `time: 01:00:00` stays the text it looks like, and without
    silently dropped duplicate keys (a sweep axis listed twice would lose its first values)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges keys that the mapping's own keys may override
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeConstructor reports it
                    continue
                seen.setdefault(key, key_node.start_mark.line)
                if first is not None:
                    raise DuplicateKey(None, None, f"key {key!r} appears twice in one mapping (first on line "
                                                   f"{first + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML 1.1's integers and floats, less their base-60 forms.
_Loader.add_implicit_resolver(
    _NUMBER_TAGS[0], re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
_Loader.add_implicit_resolver(
    _NUMBER_TAGS[1], re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def split_config_args(words: typing.Sequence[str]) -> tuple[str | None, list[str]]:
    """The optional YAML path and the overrides, each key at most once (as in YAML): a first word with '=' that is no
    file is an override."""
    words = list(words)
    path = words.pop(0) if words and ("=" not in words[0] or Path(words[0]).is_file()) else None
    _refuse_repeated(words)
    return path, words


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    problem = path_problem(path, "file")
    if problem is not None:
        raise ConfigError(f"config file {str(path)!r} {problem}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                          "save the config file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_Loader)
    except DuplicateKey as exc:
        raise ConfigError(f"{path}:{exc.problem_mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None


Layer = tuple[str, dict[str, Any]]  # (where the values come from, {section: {key: value}})


def nested(dotted: typing.Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`{"section.key": value}` as the section mapping apply_dict takes."""
    tree: dict[str, dict[str, Any]] = {}
    for key, value in dotted.items():
        section, _, name = key.partition(".")
        tree.setdefault(section, {})[name] = value
    return tree


def overrides_tree(overrides: typing.Iterable[str]) -> dict[str, dict[str, Any]]:
    """`section.key=value` words as the section mapping apply_dict takes (the last of a key wins)."""
    return nested(dict(parse_override(text) for text in overrides))


def config_layers(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> list[Layer]:
    """The YAML file, then the command line's `section.key=value` words."""
    layers: list[Layer] = [(str(path), read_yaml(path))] if path else []
    tree = overrides_tree(overrides)
    return [*layers, ("command line", tree)] if tree else layers


def _refuse_repeated(overrides: typing.Sequence[str]) -> None:
    """A key given twice would silently take its last value, where a YAML file refuses the same."""
    first: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        if key in first:
            raise ConfigError(f"{key} is given twice on the command line ({key}={first[key]} and {key}={value}); "
                              "keep one")
        first[key] = value


def resolve_layers(layers: typing.Sequence[Layer]) -> tuple[Config, dict[str, str]]:
    """Defaults with each layer applied in turn, validated; and, per `section.key`, the origin of the
    layer that set it last ("default" where none did), which `gptpar config show` prints."""
    cfg, origins = Config(), {}
    for origin, data in layers:
        try:
            cfg = apply_dict(cfg, data, origin=origin)
        except ConfigError as exc:  # a bad value names the file it came from; the command line is the user's own
            if origin == "command line" or str(exc).startswith(f"{origin}: "):
                raise
            raise ConfigError(f"{origin}: {exc}") from None
        for section, values in (data or {}).items():
            origins.update({f"{section}.{key}": origin for key in values})
    validate(cfg)
    return cfg, origins


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides (no user defaults: gptpar.user_defaults adds those)."""
    return resolve_layers(config_layers(path, overrides))[0]


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a resolved config, e.g. the one saved in a run folder or sent to a job."""
    cfg = apply_dict(Config(), data)
    validate(cfg)
    return cfg



def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# Model keys whose 0 or auto keeps the shape's value: key -> the ModelShape field that holds it.
SHAPE_KEYS = {"arch": "arch", "n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head", "n_kv_head": "n_kv_head",
              "n_positions": "n_positions", "n_experts": "n_experts", "moe_top_k": "top_k"}


def shape_values(cfg: Config) -> dict[str, tuple[Any, str]]:
    """The model keys left at 0 or auto, each with the value the preset (or pretrained folder) gives it and which:
    `config show` prints what a run builds, not the placeholder. The output must still load, so a pretrained
    folder's sizes (which may not be set beside it) stay placeholders with the folder's value in the comment, and
    GPT-2, which has no key/value heads of its own, shows none."""
    model = cfg.model
    shape = model.shape()
    folder = folder_of(model.init) is not None
    why = f"pretrained {model.init}" if folder else f"preset {model.preset}"
    found = {}
    for key, field_name in SHAPE_KEYS.items():
        placeholder = getattr(model, key)
        if placeholder not in (0, "auto") or (key == "n_kv_head" and shape.arch == "gpt2"):
            continue
        value = getattr(shape, field_name)
        value = value or shape.n_head if key == "n_kv_head" else value
        found[f"model.{key}"] = (placeholder, f"{why}: {value}") if folder else (value, why)
    return found


def to_yaml_with_origins(cfg: Config, origins: typing.Mapping[str, str],
                         resolved: typing.Mapping[str, tuple[Any, str]] | None = None) -> str:
    """The resolved config as YAML that still loads, each key's line ending in a comment naming where
    its value came from (default, detected cluster, user file, environment, config file, command line); a key in
    `resolved` (left at its placeholder, 0 or '') shows the value it resolves to and what gives it (`preset
    gpt2-mini`, `profile bridges2`)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"{section}:")
        for key, value in values.items():
            dotted = f"{section}.{key}"
            value, origin = (resolved or {}).get(dotted, (value, origins.get(dotted, "default")))
            text = f"  {yaml.safe_dump({key: value}, default_flow_style=True, width=1 << 20)[1:-2]}"
            lines.append(f"{text:<44} # {origin}")
    return "\n".join(lines) + "\n"


def config_digest(cfg: Config) -> str:
    """A short hash of the resolved config: a run folder belongs to exactly one config."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# The rank grid's dimensions, slowest- to fastest-varying over global ranks, so that the ranks of one
