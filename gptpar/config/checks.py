"""Checks of a config as a whole: those that involve several keys, then each parallelism's check of its own keys
(parallel_checks.py, which reads the strategy tables of gptpar/strategies), and the values the rest of gptpar derives
from validated keys."""

from __future__ import annotations

import dataclasses
import math

from gptpar.architectures import ARCHITECTURES, CLASSIFIER_ARCHS, MOE_ARCHS
from gptpar.config.parallel_checks import PARALLEL_CHECKS
from gptpar.config.schema import PAIR_TASKS, RUN_ID_MAX, Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from gptpar.errors import ConfigError
from gptpar.presets import PRESETS
from gptpar.pretrained import PREFIX, check_named, check_tokenizer, check_weights, folder_config, folder_of
from gptpar.strategies.data_parallel import DP_STRATEGIES, either

TRANSLATION_SOURCES = ("jsonl:", "tsv:", "hf:")
# data.task=classify's sources: the embedded set (gptpar.data.images), and the named sets and any hub image set
# (gptpar.data.image_store's names, read by gptpar.data.image_sets)
IMAGE_SOURCES = ("synthetic", "cifar100", "food101", "hf:NAME[:CONFIG]")
SFT_SAMPLE = "metamath_sample"  # the bundled MetaMathQA-style pairs (gptpar/data/samples)
PRETRAINED_ON_META = ("model.init=pretrained loads real weights and cannot use model.init_device=meta; "
                      "use model.init_device=cpu or model.init=random")
INITS = ("random", "pretrained", f"{PREFIX}PATH")
TOKENIZERS = ("auto", "gpt2", "bpe", "bytes", f"{PREFIX}PATH")
SHAPE_KEYS = ("arch", "n_layer", "n_embd", "n_head", "n_kv_head", "n_positions", "n_experts",
              "moe_top_k", "image_size")  # what a folder's weights fix


def validate(cfg: Config) -> None:
    """Checks that involve several keys, then each parallelism's check of its own keys."""
    t, p = cfg.train, cfg.parallel
    per_step = p.dp * t.grad_accum
    if t.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not divide by parallel.dp*train.grad_accum="
            f"{p.dp}*{t.grad_accum}; use a multiple of {per_step}")
    _check_weights_and_tokenizer(cfg)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} is above train.lr={t.lr}")
    if p.stuck_after_s >= p.timeout_s:
        raise ConfigError(f"parallel.stuck_after_s={p.stuck_after_s:g} is not below parallel.timeout_s="
                          f"{p.timeout_s:g}: the job would fail before it shows stuck; use less, or 0 (half of "
                          "parallel.timeout_s)")
    if len(cfg.log.run_id) > RUN_ID_MAX:
        raise ConfigError(f"log.run_id: {len(cfg.log.run_id)} characters is too long for a folder name; use at most "
                          f"{RUN_ID_MAX}")
    _check_shape(cfg.model)
    checkpoint_interval(t.activation_checkpointing)
    profiled_steps(t)
    if t.compile == "model" and (obstacle := whole_compile_obstacle(cfg)):
        raise ConfigError(f"train.compile=model compiles the whole model as one graph, but {obstacle}; use "
                          "train.compile=blocks")
    for check in PARALLEL_CHECKS:
        check(cfg)
    _validate_task(cfg)
    _check_classifier(cfg)
    _check_moe_layout(cfg)
    _check_packing(cfg)
    _check_example_fits(cfg)


def _check_weights_and_tokenizer(cfg: Config) -> None:
    """model.init and data.tokenizer name a known kind or a folder that holds what they read; a folder's weights fix
    the shape (no size key may change it) and come with their own tokenizer."""
    model, data = cfg.model, cfg.data
    check_named(model.init, "model.init")
    check_named(data.tokenizer, "data.tokenizer")
    folder = folder_of(model.init)
    if model.init not in INITS[:2] and folder is None:
        raise ConfigError(f"model.init={model.init!r} is not allowed; use {', '.join(INITS)}")
    if data.tokenizer not in TOKENIZERS[:-1] and folder_of(data.tokenizer) is None:
        raise ConfigError(f"data.tokenizer={data.tokenizer!r} is not allowed; use {', '.join(TOKENIZERS)}")
    if model.init != "random" and model.init_device == "meta":
        raise ConfigError(PRETRAINED_ON_META)
    if (tokenizer_folder := folder_of(data.tokenizer)) is not None:
        check_tokenizer(tokenizer_folder, "data.tokenizer")
    if folder is None:
        return
    model.shape()  # a missing folder, config.json or architecture first: the weights' check assumes a folder
    defaults = ModelConfig()
    changed = [key for key in SHAPE_KEYS if getattr(model, key) != getattr(defaults, key)]
    if changed:
        raise ConfigError(f"model.{changed[0]}={getattr(model, changed[0])}: the weights of model.init={model.init} "
                          f"fix the model's shape; leave model.{changed[0]} unset")
    check_weights(folder)
    if ARCHITECTURES[model.shape().arch].classifier:  # an image classifier's folder has no tokenizer to check
        return
    rows = folder_config(folder).get("vocab_size")
    if data.source == "synthetic" and isinstance(rows, int) and data.vocab_size > rows:
        raise ConfigError(f"data.vocab_size={data.vocab_size}: data.source=synthetic draws token ids below it, but the "
                          f"token table of model.init={model.init} has {rows} rows; use data.vocab_size={rows} or less")
    if data.tokenizer not in ("auto", model.init) and data.source != "synthetic":
        raise ConfigError(f"data.tokenizer={data.tokenizer}: the weights of model.init={model.init} were trained "
                          "with their folder's tokenizer; leave data.tokenizer=auto (it reads it)")
    check_tokenizer(folder, "model.init")


def data_config(cfg: Config) -> DataConfig:
    """The data section as the model needs it: data.tokenizer=auto under a pretrained folder is the folder's."""
    if cfg.data.tokenizer == "auto" and folder_of(cfg.model.init) is not None:
        return dataclasses.replace(cfg.data, tokenizer=cfg.model.init)
    return cfg.data


def _check_shape(model: ModelConfig) -> None:
    """Heads must split the width, and query heads share key/value heads in equal groups."""
    shape = model.shape()
    if shape.n_embd % shape.n_head:
        raise ConfigError(f"model.n_embd={shape.n_embd} does not divide by model.n_head={shape.n_head}; use a head "
                          "count that divides the width")
    if shape.n_head % shape.kv_heads:
        raise ConfigError(f"model.n_kv_head={shape.kv_heads} must divide model.n_head={shape.n_head} (each key/value "
                          "head serves an equal group of query heads)")
    if shape.arch == "gpt2" and model.n_kv_head:
        raise ConfigError(f"model.n_kv_head={model.n_kv_head}: GPT-2 has no grouped-query attention; leave it 0 or "
                          "use model.arch=llama or qwen2")
    if shape.arch in MOE_ARCHS and not shape.moe:
        raise ConfigError(f"model.arch={shape.arch} is a mixture of experts, and model.preset={model.preset} has none; "
                          "set model.n_experts and model.moe_top_k, or use a preset of one (e.g. mixtral-tiny)")
    if shape.moe and not 1 <= shape.top_k <= shape.n_experts:
        raise ConfigError(f"model.moe_top_k={shape.top_k} must be between 1 and model.n_experts={shape.n_experts} "
                          "(each token goes to that many of the block's experts)")
    if not shape.moe and (model.n_experts or model.moe_top_k or model.moe_capacity_factor):
        key = next(k for k in ("n_experts", "moe_top_k", "moe_capacity_factor") if getattr(model, k))
        raise ConfigError(f"model.{key}={getattr(model, key)}: {shape.arch} has no experts; use model.arch="
                          f"{' or '.join(MOE_ARCHS)} (or a preset of one, e.g. qwen2-moe-tiny)")
    # Capacity is ceil(c * tokens * top_k / n_experts): past c = n_experts it exceeds every pick there is.
    if shape.moe and model.moe_capacity_factor > shape.n_experts:
        raise ConfigError(f"model.moe_capacity_factor={model.moe_capacity_factor:g} is above model.n_experts="
                          f"{shape.n_experts}, where each expert has room for every pick of every token already; "
                          f"use at most {shape.n_experts}, or 0 to route every token")
    if model.init == "pretrained" and shape.arch != "gpt2":
        raise ConfigError(f"model.init=pretrained loads GPT-2's hub weights, not {shape.arch}'s; use model.init=random")


def whole_compile_obstacle(cfg: Config) -> str:
    """Why train.compile=model cannot capture this layout's model as one graph ("" when it can): the pipelines and
    tensor parallelism split it over stages or ranks, our fsdp gathers each block in hooks."""
    p = cfg.parallel
    if p.pp > 1 or p.pp_mode != "single":
        return "a pipeline runs it stage by stage" if p.pp > 1 else f"parallel.pp_mode={p.pp_mode} splits it"
    if p.tp > 1:
        return f"parallel.tp={p.tp} runs it as pieces joined by collectives"
    row = DP_STRATEGIES[p.dp_sync]
    return f"parallel.dp_sync={p.dp_sync} {row.without_whole_compile}" if p.dp > 1 and row.without_whole_compile else ""


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



def _validate_task(cfg: Config) -> None:
    """data.task against the source and the weights it can train."""
    d = cfg.data
    if d.task == "classify":  # _check_classifier's
        return
    if d.task == "lm":
        if d.source.startswith(TRANSLATION_SOURCES[:2]):
            raise ConfigError(f"data.source={d.source!r} holds translation pairs; set data.task=translation")
        if d.val_fraction == 0:  # every lm source is split by position: nothing would be left to validate on
            raise ConfigError("data.val_fraction=0 holds out no text for validation, which data.task=lm needs; use "
                              "a fraction above 0 (the default is 0.1)")
        return
    if d.task == "sft":
        if not (d.source == SFT_SAMPLE or d.source.startswith(("jsonl:", "hf:"))):
            raise ConfigError(f"data.task=sft reads question/response pairs: data.source={d.source!r} is not allowed; "
                              f"use {SFT_SAMPLE} (bundled), jsonl:TRAIN[,VALID[,TEST]] or hf:NAME (e.g. "
                              "hf:meta-math/MetaMathQA)")
    elif not d.source.startswith(TRANSLATION_SOURCES):
        raise ConfigError(f"data.task=translation reads pairs: data.source={d.source!r} is not allowed; use "
                          "jsonl:PATH, tsv:PATH or hf:NAME (e.g. hf:bbaaaa/iwslt14-de-en-preprocess)")
    if cfg.model.init == "pretrained" or (d.task == "translation" and cfg.model.init != "random"):
        folder = " or, for sft, a save_pretrained folder (model.init=pretrained:PATH) whose tokenizer frames the pairs"
        raise ConfigError(f"data.task={d.task} adds two tokens (<sep>, <eos>) to the vocabulary, which pretrained "
                          f"weights lack; use model.init=random{folder if d.task == 'sft' else ''}")


def _check_classifier(cfg: Config) -> None:
    """data.task=classify trains an image classifier (vit) and an image classifier nothing else, on whole patches of
    an image source's images; it runs whole on each rank, under data parallelism only."""
    d, model, shape = cfg.data, cfg.model, cfg.model.shape()
    classifier, presets = ARCHITECTURES[shape.arch].classifier, image_presets()
    if d.task == "classify" and not classifier:
        raise ConfigError(f"data.task=classify trains an image classifier; model.arch={shape.arch} (model.preset="
                          f"{model.preset}) is a language model; use model.preset={' or '.join(presets)}")
    if classifier and d.task != "classify":
        raise ConfigError(f"model.arch={shape.arch} classifies images; data.task={d.task} is a language task; use "
                          "data.task=classify")
    if not classifier:
        if shape.patch_size or model.image_size:
            raise ConfigError(f"model.preset={model.preset} with model.image_size={shape.image_size}: an image size "
                              f"is an image classifier's; model.arch={shape.arch} is a language model; use "
                              f"model.arch={' or '.join(CLASSIFIER_ARCHS)} with data.task=classify")
        return
    if not shape.patch_size:
        raise ConfigError(f"model.arch={shape.arch} needs an image preset: model.preset={model.preset} has no image or "
                          f"patch size; use model.preset={' or '.join(presets)}")
    if shape.image_size % shape.patch_size:
        raise ConfigError(f"model.image_size={shape.image_size} is not a multiple of the {shape.patch_size}-pixel "
                          f"patches of model.preset={model.preset}; use a multiple of {shape.patch_size}")
    if d.source not in IMAGE_SOURCES[:-1] and not d.source.startswith("hf:"):
        raise ConfigError(f"data.source={d.source!r} is not an image source; data.task=classify reads "
                          f"{', '.join(IMAGE_SOURCES)}")
    if cfg.train.loss_kernel not in ("auto", "plain"):
        raise ConfigError(f"train.loss_kernel={cfg.train.loss_kernel} chooses a language model's cross-entropy; an "
                          "image classifier's (one row per image) is plain: use train.loss_kernel=auto or plain")
    if (split := model_splitter(cfg.parallel)) is not None:
        key = split.partition("=")[0]
        raise ConfigError(f"{split} with model.arch={shape.arch} is not built: an image classifier runs whole on each "
                          f"rank, under data parallelism (parallel.dp, any parallel.dp_sync); use "
                          f"{key}={'single' if key == 'parallel.pp_mode' else 1}")


def image_presets() -> list[str]:
    """The presets of an image classifier."""
    return [name for name, shape in PRESETS.items() if shape.patch_size]


def _check_moe_layout(cfg: Config) -> None:
    """A mixture of experts trains under data parallelism (every dp_sync), our tensor parallelism (every rank of a
    tp group runs the whole mixture, on the same tokens or, under sequence parallelism, on its own shard, whose
    gradients it sums over the group after the sync: whole gradients only) and the multi-process pipeline (its
    micro-batches carry the router statistics from stage to stage), together too, uncompiled: the statistics are
    gathered by hooks on the routers. The one-process pipeline modes do not carry them."""
    shape, p = cfg.model.shape(), cfg.parallel
    if not shape.moe:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} splits a mixture's experts; {shape.arch} has none; use model.arch="
                              f"{' or '.join(MOE_ARCHS)} (or a preset of one, e.g. qwen2-moe-tiny), or parallel.ep=1")
        return
    if p.dp > 1:  # else a job's shape or its launcher may still fill parallel.dp in
        check_expert_grid(cfg)
    if shape.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.n_experts={shape.n_experts} (each rank of a group "
                          "holds n_experts / ep of every block's experts)")
    if p.ep > 1 and cfg.train.dump_grads:
        raise ConfigError(f"train.dump_grads with parallel.ep={p.ep}: each rank holds only its own experts' gradients; "
                          "dump them with parallel.ep=1")
    if p.ep > 1 and not DP_STRATEGIES[p.dp_sync].expert_parallel:
        raise ConfigError(f"parallel.ep={p.ep} with parallel.dp_sync={p.dp_sync} is not built yet; use "
                          f"{either([n for n, row in DP_STRATEGIES.items() if row.expert_parallel])}")
    if p.tp > 1:  # our tensor parallelism keeps each mixture whole
        if p.tp_impl != "gptpar":
            raise ConfigError(f"parallel.tp_impl={p.tp_impl} with a mixture of experts ({shape.arch}) is not built "
                              "yet; use parallel.tp_impl=gptpar (each rank runs the whole mixture)")
        if p.sequence_parallel and p.dp > 1 and not DP_STRATEGIES[p.dp_sync].whole_gradients:
            raise ConfigError(f"parallel.sequence_parallel=true with a mixture of experts ({shape.arch}) and "
                              f"parallel.dp_sync={p.dp_sync} is not built yet (the mixture's gradients are summed "
                              "over the tp group after the sync, on whole gradients); use "
                              f"{either([n for n, row in DP_STRATEGIES.items() if row.whole_gradients])}")
    elif p.pp == 1 and p.pp_mode != "single":
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} with a mixture of experts ({shape.arch}) is not built yet "
                          "(its one-process pipeline does not carry the router statistics); use parallel.pp > 1, the "
                          "multi-process pipeline")
    if cfg.train.compile not in ("auto", "false"):
        raise ConfigError(f"train.compile={cfg.train.compile} with a mixture of experts is not built yet (its routers "
                          "are watched by hooks); use train.compile=auto or false")


def check_expert_grid(cfg: Config) -> None:
    """parallel.ep inside the final parallel.dp: `validate` defers it while dp is 1, and the submit side (after the
    job's shape) and the ranks (after their launcher's count) call it."""
    p = cfg.parallel
    if p.dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide parallel.dp={p.dp} (expert parallelism runs inside data "
                          "parallelism: groups of ep replicas share the experts)")


def _check_packing(cfg: Config) -> None:
    """Packed rows carry their examples' position ids and mask into the model's own forward, which only layouts that
    run the model whole call."""
    d = cfg.data
    if not d.packing:
        return
    if d.task not in PAIR_TASKS:
        raise ConfigError(f"data.packing=true packs pair examples; data.task={d.task} trains on blocks that are full "
                          "already; use data.task=sft or translation, or data.packing=false")
    if (split := model_splitter(cfg.parallel)) is not None:
        raise ConfigError(f"data.packing=true needs the model run whole, which {split} splits; use "
                          "data.packing=false there")


def model_splitter(p: ParallelConfig) -> str | None:
    """The key (as `key=value`) that runs the model in pieces rather than whole: the multi-process pipeline, tensor
    parallelism or a one-process pipeline mode; None where every rank runs it whole."""
    if p.pp > 1:
        return f"parallel.pp={p.pp}"
    if p.tp > 1:
        return f"parallel.tp={p.tp}"
    return f"parallel.pp_mode={p.pp_mode}" if p.pp_mode != "single" else None


def context_length(model: ModelConfig) -> int:
    """The model's positions: model.n_positions (0: the preset's); pretrained weights fix the preset's."""
    shape = model.shape()
    return PRESETS[model.preset].n_positions if model.init == "pretrained" else shape.n_positions


def check_context(seq_len: int | None, model: ModelConfig) -> None:
    """A block of data.seq_len tokens must fit the model's position table (build_model checks it too, for callers
    that build a model without a validated config)."""
    n_positions = context_length(model)
    if seq_len is not None and seq_len > n_positions:
        pretrained = model.init != "random"
        fix = "(pretrained weights fix the context length)" if pretrained else "or raise model.n_positions"
        raise ConfigError(f"data.seq_len={seq_len} is above model.n_positions={n_positions}, the model's "
                          f"context length; lower data.seq_len {fix}")


def _check_example_fits(cfg: Config) -> None:
    """The longest example fits the position table: checked with the config, so every layout (one process, local
    ranks, a SLURM job) refuses it before a run folder or a rank exists."""
    d, p = cfg.data, cfg.parallel
    if d.task == "classify":  # an image's patches are its positions: the preset's by construction
        return
    if d.task == "lm":
        check_context(d.seq_len, cfg.model)
        return
    positions, width = d.max_source_len + d.max_target_len + 1, example_width(cfg)
    if width > (n_positions := context_length(cfg.model)):
        padded = f" ({width} padded to a multiple of parallel.tp={p.tp})" if width != positions else ""
        raise ConfigError(f"data.max_source_len + data.max_target_len + 1 = {positions}{padded} positions exceed "
                          f"model.n_positions={n_positions}; lower them or raise model.n_positions")


def example_width(cfg: Config) -> int:
    """The positions of the longest example: data.seq_len, an image's patches and class token, or for translation
    source, <sep> and target (rounded up to a multiple of parallel.tp under sequence parallelism, whose sequence
    shards must be equal, and of the chunks context parallelism cuts a row into)."""
    d, p = cfg.data, cfg.parallel
    if d.task == "lm":
        return d.seq_len
    if d.task == "classify":  # an image's patches and its class token
        return cfg.model.shape().n_positions
    shards = p.tp if p.tp > 1 and p.sequence_parallel else 1
    if p.cp > 1:  # a row is cut into 2 cp chunks, two a rank (the load-balanced split of either implementation)
        shards = math.lcm(shards, 2 * p.cp)
    return -(-(d.max_source_len + d.max_target_len + 1) // shards) * shards


def fixed_width(cfg: Config) -> int | None:
    """The width every translation batch is padded to where shapes must not vary from batch to batch: under the
    multi-process pipeline (its stages allocate receive buffers from the shape), sequence parallelism (equal
    shards), context parallelism (equal chunks) and packing (the rows' width); None elsewhere, where each batch is
    padded to its longest example, and for lm (blocks of one width)."""
    p = cfg.parallel
    fixed = cfg.data.task in PAIR_TASKS and (p.pp > 1 or (p.tp > 1 and p.sequence_parallel) or p.cp > 1
                                             or cfg.data.packing)
    return example_width(cfg) if fixed else None

