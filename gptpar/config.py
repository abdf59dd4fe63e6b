"""One typed config tree, loaded from YAML and `section.key=value` overrides.

Every field carries its help text, allowed values and range in its metadata, so validation,
error messages and the README's config reference all come from this one file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gptpar.errors import GptparError
from gptpar.presets import PRESETS
from gptpar.strategies.schedules import SCHEDULES, make_plan


class ConfigError(GptparError):
    """A bad config value; the message is one line naming the key and what is allowed."""


PRECISIONS = ("fp32", "bf16", "fp16", "tf32")
TASKS = ("lm", "translation")
TRANSLATION_SOURCES = ("jsonl:", "tsv:", "hf:")
PRETRAINED_ON_META = ("model.init=pretrained loads real weights and cannot use model.init_device=meta; "
                      "use model.init_device=cpu or model.init=random")


def opt(default: Any, help: str, choices: tuple | None = None, min: float | None = None,
        max: float | None = None) -> Any:
    """A dataclass field with its documentation and constraints attached."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    preset: str = opt("gpt2-tiny", "Named GPT-2 shape (gptpar/presets.py).",
                      choices=tuple(PRESETS))
    n_layer: int = opt(0, "Transformer blocks; 0 keeps the preset's.", min=0, max=4096)
    n_embd: int = opt(0, "Hidden width; 0 keeps the preset's.", min=0, max=65_536)
    n_head: int = opt(0, "Attention heads; 0 keeps the preset's.", min=0, max=4096)
    n_positions: int = opt(0, "Context length of the position table; 0 keeps the preset's.", min=0,
                           max=1_048_576)
    dropout: float = opt(0.0, "Dropout on embeddings, attention and residuals.", min=0.0, max=1.0)
    init: str = opt("random", "random: seeded random weights; pretrained: hub weights (needs the hub).",
                    choices=("random", "pretrained"))
    init_device: str = opt("cpu", "Where the model is built: cpu builds it whole; meta builds it without memory and "
                           "lets each rank materialise only what it holds (its shard under parallel.dp_sync=fsdp), "
                           "seeded per parameter so the values equal a cpu build.", choices=("cpu", "meta"))


@dataclass(frozen=True)
class DataConfig:
    task: str = opt("lm", "lm: next-token prediction on blocks of text; translation: German-to-English pairs as "
                    "`source <sep> target <eos>`, the loss on target tokens only, BLEU at each epoch end "
                    "(data.source jsonl:, tsv: or hf:).", choices=TASKS)
    source: str = opt("stdlib", "stdlib | tinyshakespeare | synthetic | text:PATH[,PATH...] | "
                      "hf:NAME[:CONFIG]; with data.task=translation jsonl:TRAIN[,VALID[,TEST]] (objects with de and "
                      "en, or {\"translation\": {...}}) | tsv:TRAIN[,VALID[,TEST]] (de, a tab, en) | "
                      "hf:NAME[:CONFIG] (e.g. hf:bbaaaa/iwslt14-de-en-preprocess; its test split when it has one); "
                      "a TEST split is only decoded and scored (test_bleu).")
    tokenizer: str = opt("auto", "auto: GPT-2 BPE from the hub, else a BPE trained on the corpus; "
                         "gpt2; bpe; bytes (256 symbols).", choices=("auto", "gpt2", "bpe", "bytes"))
    vocab_size: int = opt(4096, "Vocabulary of a trained BPE (and of synthetic data).", min=257,
                          max=16_777_216)
    seq_len: int = opt(128, "Tokens per example; a block holds seq_len + 1 tokens.", min=2,
                       max=1_048_576)
    max_source_len: int = opt(64, "data.task=translation: source tokens kept per pair (longer sources are cut); an "
                              "example has at most max_source_len + max_target_len + 1 positions, the width every "
                              "batch is padded to under parallel.pp > 1 or sequence parallelism (rounded up to a "
                              "multiple of parallel.tp there).", min=1,
                              max=1_048_576)
    max_target_len: int = opt(64, "data.task=translation: target tokens kept per pair (then the end token), and the "
                              "most tokens greedy decoding generates before it.", min=1, max=1_048_576)
    val_fraction: float = opt(0.1, "Share of the corpus held out for validation.", min=0.0, max=0.5)
    max_chars: int = opt(2_000_000, "Characters of text read from the corpus; 0 reads all.", min=0)
    synthetic_tokens: int = opt(1_000_000, "Corpus length of the synthetic source.", min=1000,
                                max=4_294_967_296)
    dir: str = opt("", "Data and cache directory; empty uses $GPTPAR_DATA_DIR or ~/.cache/gptpar.")
    streaming: bool = opt(False, "Stream hf: datasets instead of downloading them whole.")
    hub_timeout_s: float = opt(3.0, "Seconds to wait when probing the Hugging Face hub.", min=0.1,
                               max=600.0)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = opt(16, "Global batch (sequences per optimizer step, over all DP ranks).", min=1,
                          max=16_777_216)
    grad_accum: int = opt(1, "Micro-steps per optimizer step.", min=1, max=65_536)
    epochs: int = opt(1, "Passes over the training split.", min=1, max=1_000_000)
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
    eval_batches: int = opt(8, "Validation batches per evaluation.", min=1, max=1_000_000)
    bleu_samples: int = opt(200, "data.task=translation: validation (and test, where the source has a test split) "
                            "pairs greedily decoded and scored with sacrebleu "
                            "(corpus BLEU) at each epoch end, sharded over the data-parallel replicas (with "
                            "parallel.pp > 1 on the model gathered whole onto one rank per replica); 0 disables "
                            "BLEU.", min=0, max=1_000_000_000)
    seed: int = opt(1337, "Seed of weights, data order and dropout.")
    checkpoint_every: int = opt(0, "Save a checkpoint every N steps; 0 only at the end and on signal.",
                                min=0)
    threads: int = opt(0, "torch intra-op threads per rank; 0 leaves torch's default.", min=0,
                       max=4096)
    precision: str = opt("fp32", "fp32; bf16 (autocast, fp32 master weights and optimizer state; CPUs too); fp16 "
                         "(autocast and a dynamic loss scale, overflowing steps skipped and logged; GPUs only); tf32 "
                         "(fp32 with TF32 matmuls, Ampere or newer GPUs).", choices=PRECISIONS)
    activation_checkpointing: str = opt("none", "Recompute block activations in backward instead of keeping them: "
                                        "none, block (every block) or an integer k (every k-th block).")
    compile: bool = opt(False, "torch.compile each transformer block (needs a C++ compiler; minutes on a CPU).")
    profile_steps: str = opt("", "Profile steps A-B (e.g. 3-5) with torch.profiler into runs/<id>/trace/rank<R>.json "
                             "(Chrome trace, viewable in Perfetto; `gptpar trace` analyses them); empty: none.")
    dump_grads: str = opt("", "Folder where each rank saves the gradients of the run's last step, synced and as the "
                          "optimizer applied them, as model<RANK>_gradients.pth ({GPT-2 parameter name: tensor}, the "
                          "assignment's check); empty: none. Not with sharded gradients (zero2, fsdp, fsdp2) or tp.")


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = opt(1, "Data-parallel ranks (spawned locally when not under SLURM or torchrun).", min=1,
                  max=65_536)
    dp_sync: str = opt("bucketed", "Data-parallel strategy: naive (all-reduce per parameter), bucketed "
                       "(overlapped flat buckets), ddp (torch DDP; not with parallel.pp > 1), zero1 (bucketed, "
                       "optimizer state sharded), zero2 (gradients sharded too), fsdp (ours, ZeRO-3: parameters "
                       "sharded too, gathered per block), fsdp2 (torch's fully_shard, the same units); the sharded "
                       "ones not with parallel.pp > 1.",
                       choices=("naive", "bucketed", "ddp", "zero1", "zero2", "fsdp", "fsdp2"))
    pp: int = opt(1, "Pipeline stages, each its own rank (the multi-process engine); the job has "
                  "dp * pp ranks. 1 keeps the one-process modes of parallel.pp_mode.", min=1, max=4096)
    pp_schedule: str = opt("1f1b", "Schedule of the multi-process pipeline (parallel.pp > 1).",
                           choices=SCHEDULES)
    pp_virtual: int = opt(1, "Model chunks per pipeline rank (interleaved_1f1b needs >= 2).", min=1,
                          max=256)
    pp_split: str = opt("", "Blocks per pipeline stage, e.g. 3,3,2 (pp * pp_virtual numbers); empty "
                        "balances them by parallel.balance.")
    tp: int = opt(1, "Tensor-parallel ranks per model replica: attention heads, MLP columns and the vocabulary split "
                  "over them (neighbouring ranks, so one node); the job has pp * dp * tp ranks.", min=1, max=4096)
    tp_impl: str = opt("gptpar", "Tensor parallelism: gptpar (ours, Megatron-style on GPT-2's Conv1D) or torch "
                       "(torch.distributed.tensor.parallel on the same plan; dp > 1 only with dp_sync=fsdp2, pp = 1).",
                       choices=("gptpar", "torch"))
    sequence_parallel: bool = opt(False, "With parallel.tp > 1: layer norms, dropout and residuals on sequence shards, "
                                  "all-gather and reduce-scatter instead of all-reduce (Megatron-SP); data.seq_len "
                                  "must divide by tp (translation pads its batches to a multiple of tp).")
    loss_parallel: bool = opt(False, "With parallel.tp > 1: the cross-entropy on vocabulary shards, never gathering "
                              "the whole logits.")
    bucket_mb: float = opt(25.0, "Bucket size of the bucketed reducer, in MB.", min=0.001,
                           max=1_048_576.0)
    backend: str = opt("auto", "auto: nccl when CUDA is visible, else gloo.",
                       choices=("auto", "gloo", "nccl"))
    timeout_s: float = opt(120.0, "Seconds before a dead or hung rank fails the job.", min=1.0,
                           max=2_592_000.0)
    pp_mode: str = opt("single", "One-process modes (parallel.pp = 1): single | model_parallel (layers "
                       "split over devices) | pipeline_parallel (GPipe micro-batches over threads).",
                       choices=("single", "model_parallel", "pipeline_parallel"))
    chunks: int = opt(4, "Micro-batches per batch in pipeline_parallel mode and in the multi-process "
                      "pipeline (parallel.pp > 1).", min=1, max=65_536)
    devices: str = opt("", "Comma-separated devices of the model/pipeline stages, e.g. cuda:0,cuda:1 "
                       "or cpu,cpu; empty uses every visible GPU, else one CPU.")
    balance: str = opt("layers", "How blocks are spread over stages: equal block counts, equal parameter "
                       "counts, or equal measured forward+backward time (embeddings and head included).",
                       choices=("layers", "params", "time"))


@dataclass(frozen=True)
class LaunchConfig:
    profile: str = opt("local", "Cluster profile: a name in gptpar/launch/profiles/ or a path to a .yaml file.")
    cluster: str = opt("auto", "auto: SLURM when reachable, else local processes.",
                       choices=("auto", "slurm", "local"))
    partition: str = opt("", "SLURM partition; empty uses the profile's default.")
    account: str = opt("", "SLURM account (-A).")
    qos: str = opt("", "SLURM QOS (-q).")
    constraint: str = opt("", "SLURM constraint (-C).")
    gpu_type: str = opt("", "GPU type, e.g. v100-32; empty uses the profile's.")
    gpus: int = opt(1, "GPUs per node (one task per GPU for DP).", min=0, max=256)
    nodes: int = opt(1, "Nodes.", min=1, max=65_536)
    cpus_per_task: int = opt(0, "CPUs per task; 0 uses the profile's default.", min=0, max=4096)
    time: str = opt("00:30:00", "Walltime, HH:MM:SS or D-HH:MM:SS.")
    signal_s: int = opt(120, "Seconds before the time limit at which USR2 asks for checkpoint+requeue.",
                        min=0, max=2_592_000)
    max_concurrent: int = opt(4, "Concurrent array tasks of a sweep.", min=1, max=65_536)
    venv: str = opt("", "Virtualenv activated in job scripts; empty uses this checkout's .venv.")
    repeat: int = opt(0, "Which repetition of a sweep point this run is (a sweep's `repeats`); it changes nothing "
                      "in training and lets the report measure run-to-run spread.", min=0, max=1000)


@dataclass(frozen=True)
class LogConfig:
    runs_dir: str = opt("runs", "Where run folders are written.")
    run_id: str = opt("", "Run folder name; empty derives NAME-<timestamp>.")
    name: str = opt("run", "Human name of the run, the prefix of its run id.")
    every: int = opt(10, "Print progress every N steps (plain-line mode).", min=1)
    progress: str = opt("auto", "auto: a bar on a terminal, lines otherwise.",
                        choices=("auto", "bar", "lines", "none"))
    tensorboard: bool = opt(False, "Also write step scalars to runs/<id>/tb/ (needs the tensorboard extra); the "
                            "JSONL log stays the source of truth.")
    wandb: str = opt("off", "Also log to Weights & Biases (needs the wandb extra): offline writes runs/<id>/wandb/ "
                     "for a later `wandb sync`, online streams (needs internet).", choices=("off", "offline", "online"))
    wandb_project: str = opt("gptpar", "W&B project of log.wandb runs.")


@dataclass(frozen=True)
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
        value = str(value)
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of: {', '.join(meta['choices'])}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{key}: {value!r} is below the minimum {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{key}: {value!r} is above the maximum {meta['max']}")
    return value


def _set(cfg: Config, dotted: str, value: Any) -> Config:
    """A copy of cfg with one key changed (configs are frozen: a resolved config is never mutated)."""
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS:
        raise ConfigError(f"unknown section {section_name!r} in {dotted!r}; sections: {', '.join(SECTIONS)}")
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"unknown key {dotted!r}; {section_name} keys: {', '.join(fields)}")
    hint = typing.get_type_hints(type(section))[key]
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
    if cfg.model.init == "pretrained" and cfg.model.init_device == "meta":
        raise ConfigError(PRETRAINED_ON_META)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} is above train.lr={t.lr}")
    if p.pp_mode == "single" and p.devices.strip() and p.dp > 1:
        raise ConfigError(f"parallel.devices={p.devices!r} places the stages of one process; with parallel.dp="
                          f"{p.dp} each rank uses its own device: leave parallel.devices empty")
    if t.dump_grads and (p.tp > 1 or (p.dp > 1 and p.dp_sync in ("zero2", "fsdp", "fsdp2"))):
        split = f"parallel.tp={p.tp}" if p.tp > 1 else f"parallel.dp_sync={p.dp_sync}"
        raise ConfigError(f"train.dump_grads saves whole gradients, but {split} leaves each rank pieces of them; "
                          "use parallel.dp_sync=naive, bucketed, ddp or zero1 with parallel.tp=1, or leave it empty")
    checkpoint_interval(t.activation_checkpointing)
    profiled_steps(t)
    _validate_pipeline(cfg)
    _validate_tensor_parallel(cfg)
    _validate_task(cfg)


def checkpoint_interval(setting: str) -> int:
    """`train.activation_checkpointing` as k: every k-th block recomputes its activations (0: none)."""
    text = setting.strip()
    if text in ("none", "block"):
        return {"none": 0, "block": 1}[text]
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ConfigError(f"train.activation_checkpointing={text!r} is not allowed; use none, block or a positive "
                      "integer k (every k-th block)")


def checkpointed_indices(n_layer: int, k: int) -> list[int]:
    """The blocks that recompute their activations under interval k: i % k == 0, so block 0 always and
    ceil(n_layer / k) in all (none for k = 0). The trainer and the HFU count both follow this."""
    return list(range(0, n_layer, k)) if k else []


def profiled_steps(t: TrainConfig) -> tuple[int, int] | None:
    """`train.profile_steps` as (first, last) optimizer steps, 1-based and inclusive; None when empty."""
    text = t.profile_steps.strip()
    if not text:
        return None
    first, _, last = text.partition("-")
    if first.isdigit() and (last or first).isdigit() and 1 <= int(first) <= int(last or first):
        return int(first), int(last or first)
    raise ConfigError(f"train.profile_steps={text!r} is not allowed; use A-B with 1 <= A <= B (steps, 1-based), "
                      "e.g. 3-5, or empty for none")


def pp_split_counts(pcfg: ParallelConfig) -> list[int] | None:
    """`parallel.pp_split` as blocks per stage, or None when the split is balanced automatically."""
    if not pcfg.pp_split.strip():
        return None
    try:
        counts = [int(word) for word in pcfg.pp_split.split(",")]
    except ValueError:
        counts = []
    stages = pcfg.pp * pcfg.pp_virtual
    if len(counts) != stages or min(counts) < 1:
        raise ConfigError(f"parallel.pp_split={pcfg.pp_split!r} must list {stages} positive block counts "
                          f"(parallel.pp * parallel.pp_virtual), e.g. {','.join(['1'] * stages)}")
    return counts


def _validate_pipeline(cfg: Config) -> None:
    """The multi-process pipeline (parallel.pp > 1) against the one-process modes, the schedule's shape,
    the batch and the model's depth."""
    t, p = cfg.train, cfg.parallel
    if p.pp == 1:
        for key, value, default in (("pp_virtual", p.pp_virtual, 1), ("pp_split", p.pp_split.strip(), "")):
            if value != default:
                raise ConfigError(f"parallel.{key}={value} applies to the multi-process pipeline only; set "
                                  "parallel.pp > 1 or leave it out")
        return
    if p.pp_mode != "single":
        raise ConfigError(f"parallel.pp={p.pp} runs each stage as its own rank; parallel.pp_mode={p.pp_mode} "
                          "drives stages from one process: use one of them (parallel.pp_mode=single with pp > 1)")
    if p.devices.strip():
        raise ConfigError(f"parallel.devices={p.devices!r} places stages inside one process; with parallel.pp="
                          f"{p.pp} each stage rank uses its own device: leave parallel.devices empty")
    if p.dp_sync == "ddp":
        raise ConfigError("parallel.dp_sync=ddp cannot sync a pipeline stage (DDP reduces inside every backward, "
                          "the engine runs many per step); use parallel.dp_sync=bucketed or naive with parallel.pp > 1")
    if p.dp_sync in ("zero1", "zero2", "fsdp", "fsdp2"):
        raise ConfigError(f"parallel.dp_sync={p.dp_sync} does not shard pipeline stages yet; use "
                          "parallel.dp_sync=bucketed or naive with parallel.pp > 1")
    replica_batch = t.batch_size // (p.dp * t.grad_accum)
    if replica_batch % p.chunks:
        raise ConfigError(f"train.batch_size={t.batch_size} gives {replica_batch} sequences per replica and "
                          f"micro-step (batch_size / (dp * grad_accum)), which do not divide into parallel.chunks="
                          f"{p.chunks} micro-batches; use a train.batch_size that is a multiple of "
                          f"{p.dp * t.grad_accum * p.chunks}")
    try:
        make_plan(p.pp_schedule, p.pp, p.chunks, p.pp_virtual)
    except GptparError as exc:
        raise ConfigError(str(exc)) from None
    counts = pp_split_counts(p)
    n_layer = cfg.model.n_layer or PRESETS[cfg.model.preset][0]
    stages = p.pp * p.pp_virtual
    if stages > n_layer:
        raise ConfigError(f"parallel.pp * parallel.pp_virtual = {stages} stages but the model has {n_layer} blocks; "
                          "every stage needs at least one block")
    if counts is not None and sum(counts) != n_layer:
        raise ConfigError(f"parallel.pp_split={p.pp_split!r} places {sum(counts)} blocks but the model has "
                          f"{n_layer}")


def _validate_tensor_parallel(cfg: Config) -> None:
    """parallel.tp against the model's shape, the sequence and the other parallelisms."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    _, n_embd, n_head, _ = PRESETS[m.preset]
    n_embd, n_head = m.n_embd or n_embd, m.n_head or n_head
    for key, value in (("model.n_head", n_head), ("the MLP width 4 * model.n_embd", 4 * n_embd)):
        if value % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} must divide {key}={value}; use a tp that divides it")
    if p.sequence_parallel and cfg.data.task == "lm" and cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true splits data.seq_len={cfg.data.seq_len} into parallel.tp="
                          f"{p.tp} shards; use a seq_len that is a multiple of {p.tp}")
    if p.pp_mode != "single":
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} drives stages from one process and cannot be combined with "
                          f"parallel.tp={p.tp}; use parallel.pp (the multi-process pipeline) instead")
    if p.tp_impl == "torch":
        if p.pp > 1:
            raise ConfigError("parallel.tp_impl=torch does not compose with parallel.pp > 1; use parallel.tp_impl="
                              "gptpar for pipeline x tensor parallelism")
        if p.dp > 1 and p.dp_sync != "fsdp2":
            raise ConfigError(f"parallel.tp_impl=torch with parallel.dp={p.dp} needs parallel.dp_sync=fsdp2 (torch's "
                              f"DTensor parameters), not {p.dp_sync}; or use parallel.tp_impl=gptpar")
    elif p.dp > 1 and p.dp_sync == "fsdp2":
        raise ConfigError("parallel.dp_sync=fsdp2 shards torch's DTensor parameters; with parallel.tp_impl=gptpar use "
                          "parallel.dp_sync=fsdp (ours), or parallel.tp_impl=torch")


def _validate_task(cfg: Config) -> None:
    """data.task against the source, the model's context and the engines that can train it."""
    d, p = cfg.data, cfg.parallel
    if d.task == "lm":
        if d.source.startswith(TRANSLATION_SOURCES[:2]):
            raise ConfigError(f"data.source={d.source!r} holds translation pairs; set data.task=translation")
        return
    if not d.source.startswith(TRANSLATION_SOURCES):
        raise ConfigError(f"data.task=translation reads pairs: data.source={d.source!r} is not allowed; use "
                          "jsonl:PATH, tsv:PATH or hf:NAME (e.g. hf:bbaaaa/iwslt14-de-en-preprocess)")
    if cfg.model.init == "pretrained":
        raise ConfigError("data.task=translation adds two tokens (<sep>, <eos>) to the vocabulary, which pretrained "
                          "weights lack; use model.init=random")
    positions, width = d.max_source_len + d.max_target_len + 1, example_width(cfg)
    n_positions = cfg.model.n_positions or PRESETS[cfg.model.preset][3]
    if width > n_positions:
        padded = f" ({width} padded to a multiple of parallel.tp={p.tp})" if width != positions else ""
        raise ConfigError(f"data.max_source_len + data.max_target_len + 1 = {positions}{padded} positions exceed "
                          f"model.n_positions={n_positions}; lower them or raise model.n_positions")


def example_width(cfg: Config) -> int:
    """The positions of the longest example: data.seq_len, or for translation source, <sep> and target (rounded up
    to a multiple of parallel.tp under sequence parallelism, whose sequence shards must be equal)."""
    d, p = cfg.data, cfg.parallel
    if d.task == "lm":
        return d.seq_len
    shards = p.tp if p.tp > 1 and p.sequence_parallel else 1
    return -(-(d.max_source_len + d.max_target_len + 1) // shards) * shards


def fixed_width(cfg: Config) -> int | None:
    """The width every translation batch is padded to where shapes must not vary from batch to batch: under the
    multi-process pipeline (its stages allocate receive buffers from the shape) and sequence parallelism (equal
    shards); None elsewhere, where each batch is padded to its longest example, and for lm (blocks of one width)."""
    p = cfg.parallel
    fixed = cfg.data.task == "translation" and (p.pp > 1 or (p.tp > 1 and p.sequence_parallel))
    return example_width(cfg) if fixed else None


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def to_yaml_with_origins(cfg: Config, origins: typing.Mapping[str, str]) -> str:
    """The resolved config as YAML that still loads, each key's line ending in a comment naming where
    its value came from (default, detected cluster, user file, environment, config file, command line)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"{section}:")
        for key, value in values.items():
            text = f"  {yaml.safe_dump({key: value}, default_flow_style=True, width=1 << 20)[1:-2]}"
            lines.append(f"{text:<44} # {origins.get(f'{section}.{key}', 'default')}")
    return "\n".join(lines) + "\n"


def config_digest(cfg: Config) -> str:
    """A short hash of the resolved config: a run folder belongs to exactly one config."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# The rank grid's dimensions, slowest- to fastest-varying over global ranks, so that the ranks of one
# tensor-parallel group are neighbours and stay on one node.
GRID_DIMS = ("pp", "dp", "tp")


def grid_sizes(cfg: Config) -> dict[str, int]:
    """Size of each grid dimension; every launcher and log follows this one function."""
    return {"pp": cfg.parallel.pp, "dp": cfg.parallel.dp, "tp": cfg.parallel.tp}


def world_size(cfg: Config) -> int:
    """Ranks (processes, one per GPU on a cluster) the config needs: the product of the grid sizes."""
    return math.prod(grid_sizes(cfg).values())


def resolve_for_launch(cfg: Config, launched: int) -> Config:
    """The rank side's resolution: under srun or torchrun the launcher fixes the rank count, and the
    config must agree with it. A config that asks for one replica takes as many as the launcher
    started (`srun gptpar train` with N tasks trains with dp=N); any other mismatch is an error."""
    if launched == world_size(cfg):
        return cfg
    other = world_size(cfg) // cfg.parallel.dp
    if cfg.parallel.dp != 1 or launched % other:
        shape = " x ".join(f"parallel.{d}={n}" for d, n in grid_sizes(cfg).items() if n > 1 or d == "dp")
        raise ConfigError(f"the config asks for {world_size(cfg)} ranks ({shape}) but the "
                          f"launcher started {launched}; set parallel.dp={launched // other or 1} or launch "
                          f"{world_size(cfg)} tasks")
    return updated(cfg, {"parallel.dp": launched // other})


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
