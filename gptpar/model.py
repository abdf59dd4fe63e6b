"""GPT-2 from transformers, randomly initialised from a named shape (or loaded from the hub)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from gptpar.config import ModelConfig
from gptpar.errors import GptparError
from gptpar.hub import hub_reachable
from gptpar.presets import PRESETS

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def gpt2_config(cfg: ModelConfig, vocab_size: int) -> GPT2Config:
    n_layer, n_embd, n_head, n_positions = PRESETS[cfg.preset]
    n_layer, n_embd = cfg.n_layer or n_layer, cfg.n_embd or n_embd
    n_head, n_positions = cfg.n_head or n_head, cfg.n_positions or n_positions
    if n_embd % n_head:
        raise GptparError(f"model.n_embd={n_embd} does not divide by model.n_head={n_head}")
    return GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        use_cache=False, tie_word_embeddings=True, bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1, attn_implementation="sdpa",
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, hub_timeout_s: float = 3.0
                ) -> GPT2LMHeadModel:
    """The same seed gives the same weights on every rank, which data parallelism relies on."""
    if cfg.init == "pretrained":
        return _pretrained(cfg, vocab_size, hub_timeout_s)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(cfg, vocab_size))


def _pretrained(cfg: ModelConfig, vocab_size: int, hub_timeout_s: float) -> GPT2LMHeadModel:
    if cfg.preset not in HUB_NAMES:
        raise GptparError(f"model.init=pretrained needs model.preset in {', '.join(HUB_NAMES)}, "
                          f"got {cfg.preset!r}")
    if vocab_size != 50257:
        raise GptparError("model.init=pretrained needs GPT-2's tokenizer: set data.tokenizer=gpt2")
    try:
        return GPT2LMHeadModel.from_pretrained(cfg.preset, local_files_only=not hub_reachable(hub_timeout_s))
    except OSError:
        raise GptparError(
            f"model.init=pretrained: weights for {cfg.preset!r} are neither reachable on the "
            "Hugging Face hub nor in the local cache (HF_HOME); use model.init=random") from None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; targets are already shifted by one (see gptpar.data)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
