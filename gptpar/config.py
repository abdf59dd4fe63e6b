"""One typed config tree, loaded from YAML and `section.key=value` overrides.

Every field carries its help text, allowed values and range in its metadata, so validation,
error messages and the README's config reference all come from this one file.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gptpar.errors import GptparError
from gptpar.presets import PRESETS


class ConfigError(GptparError):
    """A bad config value; the message is one line naming the key and what is allowed."""


def opt(default: Any, help: str, choices: tuple | None = None, min: float | None = None,
        max: float | None = None) -> Any:
    """A dataclass field with its documentation and constraints attached."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    preset: str = opt("gpt2-tiny", "Named GPT-2 shape (gptpar/presets.py).",
                      choices=tuple(PRESETS))
    n_layer: int = opt(0, "Transformer blocks; 0 keeps the preset's.", min=0)
    n_embd: int = opt(0, "Hidden width; 0 keeps the preset's.", min=0)
    n_head: int = opt(0, "Attention heads; 0 keeps the preset's.", min=0)
    n_positions: int = opt(0, "Context length of the position table; 0 keeps the preset's.", min=0)
    dropout: float = opt(0.0, "Dropout on embeddings, attention and residuals.", min=0.0, max=1.0)
    init: str = opt("random", "random: seeded random weights; pretrained: hub weights (needs the hub).",
                    choices=("random", "pretrained"))


@dataclass
class DataConfig:
    source: str = opt("stdlib", "stdlib | tinyshakespeare | synthetic | text:PATH[,PATH...] | "
                      "hf:NAME[:CONFIG].")
    tokenizer: str = opt("auto", "auto: GPT-2 BPE from the hub, else a BPE trained on the corpus; "
                         "gpt2; bpe; bytes (256 symbols).", choices=("auto", "gpt2", "bpe", "bytes"))
    vocab_size: int = opt(4096, "Vocabulary of a trained BPE (and of synthetic data).", min=257)
    seq_len: int = opt(128, "Tokens per example; a block holds seq_len + 1 tokens.", min=2)
    val_fraction: float = opt(0.1, "Share of the corpus held out for validation.", min=0.0, max=0.5)
    max_chars: int = opt(2_000_000, "Characters of text read from the corpus; 0 reads all.", min=0)
    synthetic_tokens: int = opt(1_000_000, "Corpus length of the synthetic source.", min=1000)
    dir: str = opt("", "Data and cache directory; empty uses $GPTPAR_DATA_DIR or ~/.cache/gptpar.")
    streaming: bool = opt(False, "Stream hf: datasets instead of downloading them whole.")
    hub_timeout_s: float = opt(3.0, "Seconds to wait when probing the Hugging Face hub.", min=0.1)


@dataclass
class TrainConfig:
    batch_size: int = opt(16, "Global batch (sequences per optimizer step, over all DP ranks).", min=1)
    grad_accum: int = opt(1, "Micro-steps per optimizer step.", min=1)
    epochs: int = opt(1, "Passes over the training split.", min=1)
    max_steps: int = opt(0, "Stop after this many optimizer steps; 0 runs all epochs.", min=0)
    lr: float = opt(6e-4, "Peak learning rate.", min=0.0)
    min_lr: float = opt(6e-5, "Learning rate at the end of the cosine decay.", min=0.0)
    warmup_steps: int = opt(10, "Linear warm-up steps.", min=0)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only).", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1.", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2.", min=0.0, max=1.0)
    grad_clip: float = opt(1.0, "Gradient-norm clip; 0 disables it.", min=0.0)
    eval_every: int = opt(50, "Evaluate every N steps (and at each epoch end); 0 only at epoch end.",
                          min=0)
    eval_batches: int = opt(8, "Validation batches per evaluation.", min=1)
    seed: int = opt(1337, "Seed of weights, data order and dropout.")
    checkpoint_every: int = opt(0, "Save a checkpoint every N steps; 0 only at the end and on signal.",
                                min=0)
    threads: int = opt(0, "torch intra-op threads per rank; 0 leaves torch's default.", min=0)


@dataclass
class ParallelConfig:
    dp: int = opt(1, "Data-parallel ranks (spawned locally when not under SLURM or torchrun).", min=1)
    dp_sync: str = opt("bucketed", "Gradient sync: naive (all-reduce per parameter), bucketed "
                       "(overlapped flat buckets), ddp (torch DDP).", choices=("naive", "bucketed", "ddp"))
    bucket_mb: float = opt(25.0, "Bucket size of the bucketed reducer, in MB.", min=0.001)
    backend: str = opt("auto", "auto: nccl when CUDA is visible, else gloo.",
                       choices=("auto", "gloo", "nccl"))
    timeout_s: float = opt(120.0, "Seconds before a dead or hung rank fails the job.", min=1.0)
    pp_mode: str = opt("single", "single | model_parallel (layers split over devices) | "
                       "pipeline_parallel (GPipe micro-batches).",
                       choices=("single", "model_parallel", "pipeline_parallel"))
    chunks: int = opt(4, "Micro-batches per batch in pipeline_parallel mode.", min=1)
    devices: str = opt("", "Comma-separated devices of the model/pipeline stages, e.g. cuda:0,cuda:1 "
                       "or cpu,cpu; empty uses every visible GPU, else one CPU.")
    balance: str = opt("layers", "How blocks are spread over devices.", choices=("layers", "params"))


@dataclass
class LaunchConfig:
    profile: str = opt("local", "Cluster profile: a name in gptpar/launch/profiles/ or a path to a .yaml file.")
    cluster: str = opt("auto", "auto: SLURM when reachable, else local processes.",
                       choices=("auto", "slurm", "local"))
    partition: str = opt("", "SLURM partition; empty uses the profile's default.")
    account: str = opt("", "SLURM account (-A).")
    qos: str = opt("", "SLURM QOS (-q).")
    constraint: str = opt("", "SLURM constraint (-C).")
    gpu_type: str = opt("", "GPU type, e.g. v100-32; empty uses the profile's.")
    gpus: int = opt(1, "GPUs per node (one task per GPU for DP).", min=0)
    nodes: int = opt(1, "Nodes.", min=1)
    cpus_per_task: int = opt(0, "CPUs per task; 0 uses the profile's default.", min=0)
    time: str = opt("00:30:00", "Walltime, HH:MM:SS or D-HH:MM:SS.")
    signal_s: int = opt(120, "Seconds before the time limit at which USR2 asks for checkpoint+requeue.",
                        min=0)
    max_concurrent: int = opt(4, "Concurrent array tasks of a sweep.", min=1)
    venv: str = opt("", "Virtualenv activated in job scripts; empty uses this checkout's .venv.")


@dataclass
class LogConfig:
    runs_dir: str = opt("runs", "Where run folders are written.")
    run_id: str = opt("", "Run folder name; empty derives NAME-<timestamp>.")
    name: str = opt("run", "Human name of the run, the prefix of its run id.")
    every: int = opt(10, "Print progress every N steps (plain-line mode).", min=1)
    progress: str = opt("auto", "auto: a bar on a terminal, lines otherwise.",
                        choices=("auto", "bar", "lines", "none"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_class(name: str) -> type:
    return typing.get_type_hints(Config)[name]


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
                raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        value = float(value)
    elif hint is str:
        if value is None:
            value = ""
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        value = str(value)
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of: {', '.join(meta['choices'])}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{key}: {value!r} is below the minimum {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{key}: {value!r} is above the maximum {meta['max']}")
    return value


def _set(cfg: Config, dotted: str, value: Any) -> None:
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS:
        raise ConfigError(f"unknown section {section_name!r} in {dotted!r}; sections: {', '.join(SECTIONS)}")
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"unknown key {dotted!r}; {section_name} keys: {', '.join(fields)}")
    hint = typing.get_type_hints(type(section))[key]
    setattr(section, key, _coerce(dotted, value, fields[key], hint))


def apply_dict(cfg: Config, data: Any, origin: str = "config") -> Config:
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
            _set(cfg, f"{section_name}.{key}", value)
    return cfg


def parse_override(text: str) -> tuple[str, str]:
    """Split `section.key=value`; the value stays text and is converted by the field's type."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, value = text.split("=", 1)
    return key.strip(), value


class _Loader(yaml.SafeLoader):
    """YAML without base-60 numbers, so `time: 01:00:00` stays the text it looks like."""


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
    """The optional YAML path and the overrides: a first word with '=' that is no file is an override."""
    words = list(words)
    if words and ("=" not in words[0] or Path(words[0]).is_file()):
        return words[0], words[1:]
    return None, words


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides, each validated as it is applied."""
    cfg = Config()
    if path:
        apply_dict(cfg, read_yaml(path), origin=str(path))
    for text in overrides:
        key, value = parse_override(text)
        _set(cfg, key, value)
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a resolved config, e.g. the one saved in a run folder or sent to a job."""
    cfg = apply_dict(Config(), data)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that involve several keys."""
    t, p = cfg.train, cfg.parallel
    per_step = p.dp * t.grad_accum
    if t.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not divide by parallel.dp*train.grad_accum="
            f"{p.dp}*{t.grad_accum}; use a multiple of {per_step}")
    if p.pp_mode == "pipeline_parallel" and p.chunks > t.batch_size // per_step:
        raise ConfigError(
            f"parallel.chunks={p.chunks} exceeds the per-rank micro-batch of "
            f"{t.batch_size // per_step} sequences")
    if p.pp_mode != "single" and p.dp > 1:
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} drives its stages from one process and cannot be "
                          f"combined with parallel.dp={p.dp} yet; use parallel.dp=1 or parallel.pp_mode=single")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} is above train.lr={t.lr}")


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def reference_markdown() -> str:
    """The README's config reference, generated so that it cannot go stale."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(_section_class(section.name)):
            meta = f.metadata
            extra = f" One of: {', '.join(meta['choices'])}." if meta.get("choices") else ""
            default = f.default if f.default != "" else '""'
            lines.append(f"| `{section.name}.{f.name}` | `{default}` | {meta['help']}{extra} |")
    return "\n".join(lines)



REFERENCE_START, REFERENCE_END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def readme_with_reference(readme: str) -> str:
    """The README text with the generated reference between its two markers."""
    head, _, rest = readme.partition(REFERENCE_START)
    _, _, tail = rest.partition(REFERENCE_END)
    return f"{head}{REFERENCE_START}\n{reference_markdown()}\n{REFERENCE_END}{tail}"
