"""GPT-2 from transformers, randomly initialised from a named shape (or loaded from the hub).

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
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import GPT2Config, GPT2LMHeadModel

from gptpar.config import PRETRAINED_ON_META, ModelConfig, check_context
from gptpar.errors import GptparError
from gptpar.hub import hub_reachable
from gptpar.presets import PRESETS

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
INIT_DEVICES = ("cpu", "meta")


def gpt2_config(cfg: ModelConfig, vocab_size: int, seq_len: int | None = None) -> GPT2Config:
    """The transformers config of cfg; with seq_len (data.seq_len), checks that a block fits."""
    n_layer, n_embd, n_head, n_positions = PRESETS[cfg.preset]
    n_layer, n_embd = cfg.n_layer or n_layer, cfg.n_embd or n_embd
    n_head, n_positions = cfg.n_head or n_head, cfg.n_positions or n_positions
    if n_embd % n_head:
        raise GptparError(f"model.n_embd={n_embd} does not divide by model.n_head={n_head}")
    check_context(seq_len, cfg)
    return GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        use_cache=False, tie_word_embeddings=True, bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1, attn_implementation="sdpa",
    )


def padded_vocab(vocab: int, multiple: int) -> int:
    """The vocabulary rounded up to a multiple."""
    return -(-vocab // multiple) * multiple


def tokenizer_vocab(config: GPT2Config) -> int:
    """The tokenizer's vocabulary of a model whose token table (config.vocab_size rows) may be padded past it; a
    config that gptpar did not pad has none."""
    return getattr(config, "unpadded_vocab_size", config.vocab_size)


def pad_config(config: GPT2Config, multiple: int) -> GPT2Config:
    """`config` (of the tokenizer's vocabulary) with its token table padded to a multiple, in place."""
    config.unpadded_vocab_size = tokenizer_vocab(config)
    config.vocab_size = padded_vocab(config.unpadded_vocab_size, multiple)
    return config


class PaddedHead(nn.Module):
    """GPT-2's LM head over a token table padded past the tokenizer's `vocab` rows: the padded columns of its logits
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


def empty_model(config: GPT2Config) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel of `config` on the meta device, its head a `PaddedHead` where the table is padded."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        if tokenizer_vocab(config) < config.vocab_size:
            model.lm_head = PaddedHead(config.n_embd, config.vocab_size, tokenizer_vocab(config))
            if config.tie_word_embeddings:
                model.lm_head.weight = model.transformer.wte.weight
    _check_tied(model)
    return model


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, hub_timeout_s: float = 3.0,
                seq_len: int | None = None, init_device: str = "cpu", shards: int = 1) -> GPT2LMHeadModel:
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
    if cfg.init == "pretrained":
        if init_device == "meta":
            raise GptparError(PRETRAINED_ON_META)
        return pad_vocabulary(_pretrained(cfg, vocab_size, hub_timeout_s, seq_len), multiple)
    config = pad_config(gpt2_config(cfg, vocab_size, seq_len), multiple)
    torch.manual_seed(seed)  # dropout draws from the global generator; the weights no longer do
    model = empty_model(config)
    if init_device == "cpu":
        materialize(model, seed, torch.device("cpu"))
    return model


@torch.no_grad()
def pad_vocabulary(model: GPT2LMHeadModel, multiple: int) -> GPT2LMHeadModel:
    """A real (pretrained) model with its token table padded to a multiple: the same weights, zero rows after them
    (what a random build pads with)."""
    config = pad_config(model.config, multiple)
    if config.vocab_size == config.unpadded_vocab_size:
        return model
    padded = empty_model(config)
    state = {name: F.pad(value, (0, 0, 0, config.vocab_size - value.size(0)))
             if name in ("transformer.wte.weight", "lm_head.weight") else value
             for name, value in model.state_dict().items()}
    padded.load_state_dict(state, assign=True)
    if config.tie_word_embeddings:  # assign put two padded copies in place of the one shared matrix
        padded.lm_head.weight = padded.transformer.wte.weight
    _check_tied(padded)
    return padded


def _pretrained(cfg: ModelConfig, vocab_size: int, hub_timeout_s: float, seq_len: int | None = None
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


# GPT2PreTrainedModel._init_weights, by parameter name: "normal" is N(0, initializer_range) (Conv1D and
# embedding weights), "residual" is N(0, initializer_range / sqrt(2 * n_layer)) (GPT-2's scaled
# projections into the residual stream), "zeros" and "ones" are constants.
_TOP_LEVEL = {"transformer.wte.weight": "normal", "transformer.wpe.weight": "normal",
              "transformer.ln_f.weight": "ones", "transformer.ln_f.bias": "zeros",
              "lm_head.weight": "normal"}
_IN_BLOCK = {"ln_1.weight": "ones", "ln_1.bias": "zeros", "ln_2.weight": "ones", "ln_2.bias": "zeros",
             "attn.c_attn.weight": "normal", "attn.c_attn.bias": "zeros",
             "attn.c_proj.weight": "residual", "attn.c_proj.bias": "zeros",
             "mlp.c_fc.weight": "normal", "mlp.c_fc.bias": "zeros",
             "mlp.c_proj.weight": "residual", "mlp.c_proj.bias": "zeros"}
_BLOCK_NAME = re.compile(r"transformer\.h\.(\d+)\.(.+)")


def _init_kind(name: str, config: GPT2Config) -> str:
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _BLOCK_NAME.fullmatch(name)
    if match and int(match[1]) < config.n_layer and match[2] in _IN_BLOCK:
        return _IN_BLOCK[match[2]]
    raise GptparError(f"no initial value is defined for a GPT-2 parameter named {name!r} "
                      f"(n_layer={config.n_layer}); add it to gptpar.model's init table")


def initial_value(name: str, shape: torch.Size, config: GPT2Config, seed: int) -> torch.Tensor:
    """The float32 CPU initial value of the GPT2LMHeadModel parameter `name` of full shape `shape`.

    Drawn on CPU from a generator seeded by (seed, name), so it is the same on every device and
    rank, and a shard of a parameter is the same slice of this tensor. A padded token table's rows
    past the tokenizer's vocabulary are zeros, the others what an unpadded table gets.
    """
    if name == "lm_head.weight" and config.tie_word_embeddings:
        name = "transformer.wte.weight"  # one matrix under two names
    kind = _init_kind(name, config)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32, device="cpu")
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32, device="cpu")
    std = config.initializer_range
    if kind == "residual":
        std /= math.sqrt(2 * config.n_layer)
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    if name in ("transformer.wte.weight", "lm_head.weight") and shape[0] > tokenizer_vocab(config):
        real = initial_value(name, torch.Size([tokenizer_vocab(config), *shape[1:]]), config, seed)
        return F.pad(real, (0, 0, 0, shape[0] - real.size(0)))  # a padded table's extra rows are zeros
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(model: GPT2LMHeadModel, seed: int) -> None:
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
    """Make a meta-device GPT2LMHeadModel, bare or inside a wrapper (e.g. fully_shard), real on
    `device` with its initial values: the same as a cpu build moved to `device`."""
    gpt2 = next((m for m in model.modules() if isinstance(m, GPT2LMHeadModel)), None)
    if gpt2 is None:
        raise GptparError(f"materialize needs a GPT2LMHeadModel, found none inside {type(model).__name__}")
    if buffers := [name for name, _ in model.named_buffers()]:
        raise GptparError(f"materialize cannot restore buffers {', '.join(buffers)} (to_empty leaves them "
                          "uninitialised); teach gptpar.model.materialize to re-create them")
    own = {id(p) for p in gpt2.parameters()}
    if outside := [name for name, p in model.named_parameters() if id(p) not in own]:
        raise GptparError(f"materialize would leave parameters outside the GPT-2 uninitialised: "
                          f"{', '.join(outside)}")
    with _params_swapped_in_place():
        model.to_empty(device=device)
    _check_tied(gpt2)
    init_parameters(gpt2, seed)


@contextlib.contextmanager
def _params_swapped_in_place() -> Iterator[None]:
    """Without this, to_empty gives each module a new Parameter and unties lm_head from wte."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _check_tied(model: GPT2LMHeadModel) -> None:
    """The LM head must be the embedding matrix itself, or training updates two copies."""
    if model.config.tie_word_embeddings and model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("lm_head.weight is no longer tied to transformer.wte.weight")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; targets are already shifted by one (see gptpar.data)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


CHUNK_ELEMENTS = 2**26  # logits per chunk of chunked_lm_loss: 256 MB in fp32


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over the rows whose target is not -100, computed chunk by chunk of `rows` rows in fp32.
    Forward keeps only each row's log-sum-exp beside the logits themselves (which the head produced anyway);
    backward recomputes each chunk's softmax and writes its gradient, (softmax - one-hot) x grad / count, straight
    into a gradient of the logits' own dtype. So neither pass holds more than one chunk in fp32, where the plain
    loss keeps fp32 log-probabilities of every logit from forward to backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        flat, target = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        keep = target != -100
        index = target.clamp(min=0)[:, None]
        lse = torch.empty(flat.size(0), dtype=torch.float32, device=flat.device)
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start in range(0, flat.size(0), rows):
            chunk, part = flat[start:start + rows].float(), slice(start, start + rows)
            lse[part] = chunk.logsumexp(-1)
            total += ((lse[part] - chunk.gather(1, index[part]).squeeze(1)) * keep[part]).sum()
        count = keep.sum()
        ctx.save_for_backward(logits, index, keep, lse, count)
        ctx.rows = rows
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, index, keep, lse, count = ctx.saved_tensors
        flat = logits.reshape(-1, logits.size(-1))
        out = torch.empty_like(flat)
        weight = keep * (grad / count)  # per row: 0 for an ignored target
        for start in range(0, flat.size(0), ctx.rows):
            part = slice(start, start + ctx.rows)
            probs = (flat[part].float() - lse[part, None]).exp_()
            probs.scatter_add_(1, index[part], -torch.ones_like(lse[part, None]))
            out[part] = probs.mul_(weight[part, None])
        return out.view_as(logits), None, None


def chunked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS
                    ) -> torch.Tensor:
    """`lm_loss` without an fp32 copy of the whole logits (train.loss_kernel=chunked): the same value and gradients up
    to fp32 rounding, -100 targets left out of the mean as F.cross_entropy leaves them."""
    return _ChunkedCrossEntropy.apply(logits, targets, max(1, chunk_elements // logits.size(-1)))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
