"""The model of a config: any architecture gptpar describes (gptpar/models), randomly initialised from a named shape
(or GPT-2 loaded from the hub).

Random weights are drawn per parameter, from a generator seeded by the run seed and the parameter's
name, so a model built on the meta device can be materialised later, or only in part (a rank's
shard), with exactly the values a plain CPU build gives.

The token table may be padded past the tokenizer's vocabulary (model.pad_vocab, and a multiple of the
tensor-parallel ranks): matmul shapes that run fast, and equal vocabulary shards. The padded rows start at
zero, `PaddedHead` sets their logits to -inf, and the real rows get the values of an unpadded build, so
training is the unpadded model's; checkpoint exports cut the padding off again.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.serialization import get_unsafe_globals_in_checkpoint
from transformers import GPT2LMHeadModel, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

from gptpar.config import PRETRAINED_ON_META, ModelConfig, TrainConfig, check_context
from gptpar.errors import GptparError, first_sentence
from gptpar.hub import hub_reachable
from gptpar.models import architecture
from gptpar.models.base import find_model
from gptpar.models.lora import adapter_part, adapter_value, base_name, inject_lora
from gptpar.pretrained import check_weights, folder_of, folder_shape

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
INIT_DEVICES = ("cpu", "meta")


def model_config(cfg: ModelConfig, vocab_size: int, seq_len: int | None = None) -> PretrainedConfig:
    """The transformers config of cfg; with seq_len (data.seq_len), checks that a block fits."""
    shape = cfg.shape()
    if shape.n_embd % shape.n_head:
        raise GptparError(f"model.n_embd={shape.n_embd} does not divide by model.n_head={shape.n_head}")
    check_context(seq_len, cfg)
    return architecture(shape.arch).config_of(shape, vocab_size, cfg.dropout)


def padded_vocab(vocab: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple."""
    return -(-vocab // multiple) * multiple


def tokenizer_vocab(config: PretrainedConfig) -> int:
    """The tokenizer's vocabulary of a model whose token table (config.vocab_size rows) may be padded past it; a
    config that gptpar did not pad has none."""
    return getattr(config, "unpadded_vocab_size", config.vocab_size)


def pad_config(config: PretrainedConfig, multiple: int) -> PretrainedConfig:
    """`config` (of the tokenizer's vocabulary) with its token table padded to a multiple, in place."""
    config.unpadded_vocab_size = tokenizer_vocab(config)
    config.vocab_size = padded_vocab(config.unpadded_vocab_size, multiple)
    return config


class PaddedHead(nn.Module):
    """The LM head over a token table padded past the tokenizer's `vocab` rows: the padded columns of its logits
    are -inf, so they never win an argmax, take no probability in a softmax and get no gradient (their rows stay
    zero). The -inf comes as the matmul's bias, which cuBLAS and inductor add in the matmul's own epilogue: no pass
    over the logits of its own. A module of its own, not an nn.Linear, so that nothing that rewrites linear layers
    (the pipeline's split backward) drops the mask."""

    def __init__(self, n_embd: int, padded: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(padded, n_embd))
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(self.weight.size(0), dtype=self.weight.dtype, device=self.weight.device)
        mask[self.vocab:] = float("-inf")
        return F.linear(hidden, self.weight, mask)


def empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model of `config` on the meta device, its head a `PaddedHead` where the table is padded."""
    arch = architecture(config)
    with torch.device("meta"):
        model = arch.model_class(config)
        if not arch.classifier and tokenizer_vocab(config) < config.vocab_size:
            model.lm_head = PaddedHead(config.hidden_size, config.vocab_size, tokenizer_vocab(config))
            if config.tie_word_embeddings:
                model.lm_head.weight = arch.token_embedding(model).weight
    _check_tied(model)
    return model


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, hub_timeout_s: float = 3.0,
                seq_len: int | None = None, init_device: str = "cpu", shards: int = 1) -> PreTrainedModel:
    """The same seed gives the same weights on every rank, which data parallelism relies on.

    Pass seq_len (data.seq_len) so that a block longer than the context fails here, in one line, instead
    of as an index error inside the first forward pass (a validated config has refused it already).
    init_device="meta" returns the model unmaterialised (no memory); `materialize` fills it later,
    on any device, with the values a "cpu" build has. The token table is padded to a multiple of
    model.pad_vocab and of `shards` (parallel.tp: the vocabulary is split into that many equal pieces).
    """
    if init_device not in INIT_DEVICES:
        raise GptparError(f"model.init_device={init_device!r} is not one of {', '.join(INIT_DEVICES)}")
    multiple = math.lcm(cfg.pad_vocab, shards)
    if cfg.init != "random":
        if init_device == "meta":
            raise GptparError(PRETRAINED_ON_META)
        folder = folder_of(cfg.init)
        loaded = _hub_gpt2(cfg, vocab_size, hub_timeout_s, seq_len) if folder is None else \
            _from_folder(cfg, folder, vocab_size, seq_len)
        return loaded if architecture(loaded).classifier else pad_vocabulary(loaded, multiple)
    config = model_config(cfg, vocab_size, seq_len)
    if not architecture(config).classifier:  # an image classifier has no token table
        pad_config(config, multiple)
    torch.manual_seed(seed)  # dropout draws from the global generator; the weights no longer do
    model = empty_model(config)
    if init_device == "cpu":
        materialize(model, seed, torch.device("cpu"))
    return model


@torch.no_grad()
def pad_vocabulary(model: PreTrainedModel, multiple: int) -> PreTrainedModel:
    """A real (pretrained) model with its token table padded to a multiple: the same weights, zero rows after them
    (what a random build pads with)."""
    config = pad_config(model.config, multiple)
    if config.vocab_size == config.unpadded_vocab_size:
        return model
    padded, arch = empty_model(config), architecture(config)
    state = {name: F.pad(value, (0, 0, 0, config.vocab_size - value.size(0)))
             if name in (arch.token_table, "lm_head.weight") else value
             for name, value in model.state_dict().items()}
    padded.load_state_dict(state, assign=True)
    arch.restore_buffers(padded, torch.device("cpu"))  # buffers outside the state dict (rotary tables) stay on meta
    if config.tie_word_embeddings:  # assign put two padded copies in place of the one shared matrix
        padded.lm_head.weight = arch.token_embedding(padded).weight
    _check_tied(padded)
    return padded


def _from_folder(cfg: ModelConfig, folder: Path, vocab_size: int, seq_len: int | None) -> PreTrainedModel:
    """A save_pretrained folder's model in float32 (precision is the trainer's), with gptpar's dropout and attention
    settings; it must cover the tokenizer's ids. Never downloads: the folder is all there is."""
    check_weights(folder)
    check_context(seq_len, cfg)
    arch = architecture(folder_shape(folder).arch)
    config = arch.model_class.config_class.from_pretrained(str(folder), local_files_only=True)
    for key in arch.dropout_keys:
        setattr(config, key, cfg.dropout)
    config.use_cache = False
    if arch.classifier and config.num_labels != vocab_size:
        raise GptparError(f"model.init=pretrained:{folder}: its classifier has {config.num_labels} classes and the "
                          f"data {vocab_size}; train on a data set of {config.num_labels} classes, or from "
                          "model.init=random")
    if not arch.classifier and config.vocab_size < vocab_size:
        raise GptparError(f"model.init=pretrained:{folder}: its token table has {config.vocab_size} rows (vocab_size "
                          f"in its config.json), fewer than the {vocab_size} ids of its own tokenizer: config.json "
                          "does not describe these weights (was it edited?); save the model and its tokenizer again "
                          "with save_pretrained")
    transformers_logging.disable_progress_bar()  # a bar per load in every rank's log says nothing
    try:  # transformers reads pickled weights (pytorch_model.bin) with torch.load(weights_only=True): tensors, no calls
        return arch.model_class.from_pretrained(str(folder), config=config, local_files_only=True,
                                                dtype=torch.float32, attn_implementation="sdpa")
    except Exception as exc:  # safetensors' and unpickling's errors are of many types, none of them OSError
        raise _weights_error(folder, exc) from None


def _named_globals(file: Path) -> list[str]:
    """The functions and classes a pickled weights file names; none where it is no pickle at all (garbage)."""
    try:
        return get_unsafe_globals_in_checkpoint(file)
    except Exception:  # not a torch.save archive: its own error is the one to report
        return []


def _weights_error(folder: Path, exc: Exception) -> GptparError:
    """Why the folder's weights do not load, in one line. Pickled weights that name a function or class are refused
    by name (torch.load stopped before calling it; its own message would advise loading them unrestricted)."""
    pickled = sorted(folder.glob("pytorch_model*.bin")) if isinstance(exc, pickle.UnpicklingError) else []
    if names := sorted({name for file in pickled for name in _named_globals(file)}):
        return GptparError(f"model.init=pretrained:{folder}: refused to load its weights: they name "
                           f"{', '.join(names)}, which weights never hold (loading them could run code); save the "
                           "model there again with save_pretrained, from a source you trust")
    return GptparError(f"model.init=pretrained:{folder}: its weights cannot be loaded ({first_sentence(exc)}); "
                       "save them again with save_pretrained")


def _hub_gpt2(cfg: ModelConfig, vocab_size: int, hub_timeout_s: float, seq_len: int | None = None
              ) -> GPT2LMHeadModel:
    if cfg.preset not in HUB_NAMES:
        raise GptparError(f"model.init=pretrained needs model.preset in {', '.join(HUB_NAMES)}, "
                          f"got {cfg.preset!r}")
    check_context(seq_len, cfg)
    if vocab_size != 50257:
        raise GptparError("model.init=pretrained needs GPT-2's tokenizer: set data.tokenizer=gpt2")
    try:
        return GPT2LMHeadModel.from_pretrained(cfg.preset, local_files_only=not hub_reachable(hub_timeout_s))
    except OSError:
        raise GptparError(
            f"model.init=pretrained: weights for {cfg.preset!r} are neither reachable on the "
            "Hugging Face hub nor in the local cache (HF_HOME); use model.init=random") from None


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed fixed by the run seed and the parameter's name alone (blake2b, unlike `hash`,
    is the same in every process), so each parameter's draw is independent of build order."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def initial_value(name: str, shape: torch.Size, config: PretrainedConfig, seed: int) -> torch.Tensor:
    """The float32 CPU initial value of the model's parameter `name` of full shape `shape`, as its architecture's
    table says (gptpar/models).

    Drawn on CPU from a generator seeded by (seed, name), so it is the same on every device and
    rank, and a shard of a parameter is the same slice of this tensor. A padded token table's rows
    past the tokenizer's vocabulary are zeros, the others what an unpadded table gets.
    """
    if (part := adapter_part(name)) is not None:  # train.lora_rank: an adapter (gptpar.models.lora)
        return adapter_value(part, shape, torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name)))
    name = base_name(name)  # an adapted layer's own weight, under the name it had before
    arch = architecture(config)
    if name == "lm_head.weight" and config.tie_word_embeddings:
        name = arch.token_table  # one matrix under two names
    kind = arch.init_kind(name, config.num_hidden_layers)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32, device="cpu")
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32, device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    if name in (arch.token_table, "lm_head.weight") and shape[0] > tokenizer_vocab(config):
        real = initial_value(name, torch.Size([tokenizer_vocab(config), *shape[1:]]), config, seed)
        return F.pad(real, (0, 0, 0, shape[0] - real.size(0)))  # a padded table's extra rows are zeros
    std = arch.init_std(kind, config)
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


@torch.no_grad()
def add_lora(model: PreTrainedModel, t: TrainConfig, seed: int) -> PreTrainedModel:
    """`model` with train.lora_rank's adapters (gptpar.models.lora), in place; unless on the meta device (where
    `materialize` draws them with the rest) they start at their `initial_value`."""
    inject_lora(model, t)
    for name, param in model.named_parameters():
        if adapter_part(name) is not None and not param.is_meta:
            param.copy_(initial_value(name, param.shape, model.config, seed))
    return model


@torch.no_grad()
def init_parameters(model: PreTrainedModel, seed: int) -> None:
    """Overwrite every parameter with its `initial_value`; a DTensor parameter (FSDP2's shards) gets
    just its local slice of it."""
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            full = initial_value(name, param.shape, model.config, seed).to(param.device, param.dtype)
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(initial_value(name, param.shape, model.config, seed))


def materialize(model: nn.Module, seed: int, device: torch.device) -> None:
    """Make a meta-device model, bare or inside a wrapper (e.g. fully_shard), real on `device` with its initial
    values: the same as a cpu build moved to `device`."""
    inner = find_model(model)
    arch = architecture(inner)
    if buffers := [name for name, _ in inner.named_buffers()
                   if not (arch.restored_buffers and name.startswith(f"{arch.restored_buffers}."))]:
        raise GptparError(f"materialize cannot restore buffers {', '.join(buffers)} (to_empty leaves them "
                          "uninitialised); teach the architecture's restore_buffers (gptpar/models) to re-create them")
    own = {id(p) for p in inner.parameters()}
    if outside := [name for name, p in model.named_parameters() if id(p) not in own]:
        raise GptparError(f"materialize would leave parameters outside the model uninitialised: "
                          f"{', '.join(outside)}")
    with _params_swapped_in_place():
        model.to_empty(device=device)
    arch.restore_buffers(inner, device)
    _check_tied(inner)
    init_parameters(inner, seed)


@contextlib.contextmanager
def _params_swapped_in_place() -> Iterator[None]:
    """Without this, to_empty gives each module a new Parameter and unties the LM head from the token table."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _check_tied(model: PreTrainedModel) -> None:
    """A tied LM head must be the token table itself, or training updates two copies (an image classifier's config
    has no tie_word_embeddings: nothing is tied)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    if model.lm_head.weight is not architecture(model).token_embedding(model).weight:
        raise RuntimeError("lm_head.weight is no longer tied to the token table")


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
