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


def check_context(seq_len: int | None, n_positions: int, fixed_by: str = "") -> None:
    """A block of data.seq_len tokens must fit the model's position table."""
    if seq_len is not None and seq_len > n_positions:
        fix = fixed_by or "or raise model.n_positions"
        raise GptparError(f"data.seq_len={seq_len} is above model.n_positions={n_positions}, the model's "
                          f"context length; lower data.seq_len {fix}")


def gpt2_config(cfg: ModelConfig, vocab_size: int, seq_len: int | None = None) -> GPT2Config:
    """The transformers config of cfg; with seq_len (data.seq_len), checks that a block fits."""
    n_layer, n_embd, n_head, n_positions = PRESETS[cfg.preset]
    n_layer, n_embd = cfg.n_layer or n_layer, cfg.n_embd or n_embd
    n_head, n_positions = cfg.n_head or n_head, cfg.n_positions or n_positions
    if n_embd % n_head:
        raise GptparError(f"model.n_embd={n_embd} does not divide by model.n_head={n_head}")
    check_context(seq_len, n_positions)
    return GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        use_cache=False, tie_word_embeddings=True, bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1, attn_implementation="sdpa",
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, hub_timeout_s: float = 3.0,
                seq_len: int | None = None) -> GPT2LMHeadModel:
    """The same seed gives the same weights on every rank, which data parallelism relies on.

    Pass seq_len (data.seq_len) so that a block longer than the context fails here, in one line,
    for every parallel mode, instead of as an index error inside the first forward pass.
    """
    if cfg.init == "pretrained":
        return _pretrained(cfg, vocab_size, hub_timeout_s, seq_len)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(cfg, vocab_size, seq_len))


def _pretrained(cfg: ModelConfig, vocab_size: int, hub_timeout_s: float, seq_len: int | None = None
                ) -> GPT2LMHeadModel:
    if cfg.preset not in HUB_NAMES:
        raise GptparError(f"model.init=pretrained needs model.preset in {', '.join(HUB_NAMES)}, "
                          f"got {cfg.preset!r}")
    check_context(seq_len, PRESETS[cfg.preset][3], "(pretrained weights fix the context length)")
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
