import pytest
import torch

from gptpar.config import ModelConfig
from gptpar.errors import GptparError
from gptpar.models.build import build_model, count_params, model_config
from gptpar.models.loss import lm_loss
from gptpar.presets import PRESETS


def test_gpt2_preset_is_124m_with_gpt2_vocab():
    cfg = model_config(ModelConfig(preset="gpt2"), 50257)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == (12, 768, 12, 1024)
    model = build_model(ModelConfig(preset="gpt2"), 50257, seed=0, init_device="meta")
    assert round(count_params(model) / 1e6) == 124 and next(model.parameters()).is_meta


def test_every_preset_builds_a_consistent_config():
    for name, shape in PRESETS.items():
        cfg = model_config(ModelConfig(preset=name), 1000)
        # an image classifier's positions are its patches and the class token
        positions = (cfg.image_size // cfg.patch_size) ** 2 + 1 if shape.patch_size else cfg.max_position_embeddings
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, positions) == (
            shape.n_layer, shape.n_embd, shape.n_head, shape.n_positions)
        assert shape.n_embd % shape.n_head == 0 and cfg.model_type == shape.arch


def test_fields_override_the_preset():
    cfg = model_config(ModelConfig(preset="gpt2-tiny", n_layer=2, n_embd=64, n_head=2, dropout=0.1), 300)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.resid_pdrop) == (2, 64, 2, 300, 0.1)
    with pytest.raises(GptparError, match="model.n_embd=100 does not divide by model.n_head=3"):
        model_config(ModelConfig(n_embd=100, n_head=3), 300)


def test_seed_fixes_the_weights():
    a = build_model(ModelConfig(), 300, seed=1)
    b = build_model(ModelConfig(), 300, seed=1)
    c = build_model(ModelConfig(), 300, seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_loss_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 5, 300)
    targets = torch.randint(0, 300, (2, 5))
    assert lm_loss(logits, targets).item() == pytest.approx(torch.log(torch.tensor(300.0)).item())


def test_pretrained_offline_fails_clearly():
    with pytest.raises(GptparError, match="model.init=pretrained: weights for 'gpt2' are neither reachable"):
        build_model(ModelConfig(preset="gpt2", init="pretrained"), 50257, seed=0)
    with pytest.raises(GptparError, match="needs GPT-2's tokenizer"):
        build_model(ModelConfig(preset="gpt2", init="pretrained"), 4096, seed=0)
