"""Per-parameter seeded initialisation: a meta build materialised later, or only a slice of it (a
rank's shard), has exactly the values of a plain cpu build, following GPT-2's init scheme."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.models.build import build_model, initial_value, materialize, model_config, parameter_seed

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_positions=64", "data.seq_len=64"]
VOCAB = 300


def tiny(seed: int = 0, init_device: str = "cpu", *overrides: str) -> nn.Module:
    cfg = load_config(None, [*TINY, *overrides])
    return build_model(cfg.model, VOCAB, seed, init_device=init_device)


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
    for (name_a, pa), (name_b, pb) in pairs:
        assert name_a == name_b
        assert pa.device == pb.device and pa.dtype == pb.dtype == torch.float32, name_a
        assert torch.equal(pa, pb), name_a


def test_meta_build_materialised_equals_a_cpu_build_bitwise():
    meta = tiny(3, "meta")
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, 3, torch.device("cpu"))
    assert_same_parameters(meta, tiny(3))


def test_materialize_finds_the_gpt2_inside_a_wrapper():
    wrapped = nn.Sequential(tiny(3, "meta"))
    materialize(wrapped, 3, torch.device("cpu"))
    assert_same_parameters(wrapped[0], tiny(3))


def test_any_slice_of_the_initial_value_is_that_slice_of_the_parameter():
    model = tiny(5)
    config = model.config
    for name, param in model.named_parameters():
        full = initial_value(name, param.shape, config, 5)
        rows = param.shape[0]
        for start, stop in ((0, rows // 2), (rows // 3, rows), (rows - 1, rows)):
            assert torch.equal(full[start:stop], param.detach()[start:stop]), name
        if param.dim() == 2:
            assert torch.equal(full[:, 1::3], param.detach()[:, 1::3]), name


def test_seed_and_name_fix_the_weights():
    a, b, c = tiny(1), tiny(1), tiny(2)
    assert_same_parameters(a, b)
    for (name, pa), pc in zip(a.named_parameters(), c.parameters(), strict=True):
        if pa.std() > 0:  # the constants (zeros, ones) do not depend on the seed
            assert not torch.equal(pa, pc), name
    h = a.transformer.h
    assert not torch.equal(h[0].attn.c_attn.weight, h[1].attn.c_attn.weight)
    assert not torch.equal(h[0].attn.c_proj.weight, h[1].attn.c_proj.weight)
    assert parameter_seed(1, "transformer.wte.weight") == parameter_seed(1, "transformer.wte.weight")
    assert 0 <= parameter_seed(1, "transformer.wte.weight") < 2**63
    assert parameter_seed(1, "transformer.wte.weight") != parameter_seed(2, "transformer.wte.weight")


def test_values_follow_gpt2s_init_scheme():
    config = model_config(load_config(None, ["model.n_layer=6", "model.n_embd=256", "model.n_head=4"]).model,
                         VOCAB)
    std, n = config.initializer_range, config.n_layer
    expected = {"transformer.wte.weight": std, "transformer.h.2.attn.c_attn.weight": std,
                "transformer.h.5.mlp.c_fc.weight": std,
                "transformer.h.0.attn.c_proj.weight": std / math.sqrt(2 * n),
                "transformer.h.4.mlp.c_proj.weight": std / math.sqrt(2 * n)}
    for name, target in expected.items():
        value = initial_value(name, torch.Size([256, 1024]), config, 0)
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        assert abs(value.mean().item()) < 0.01 * std
        assert value.std().item() == pytest.approx(target, rel=0.02), name
    model = tiny(0)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif ".ln_" in name:
            assert torch.equal(param, torch.ones_like(param)), name


def test_the_lm_head_stays_tied_to_the_embedding():
    for model in (tiny(0), tiny(0, "meta")):
        assert model.lm_head.weight is model.transformer.wte.weight
    meta = tiny(0, "meta")
    materialize(meta, 0, torch.device("cpu"))
    assert meta.lm_head.weight is meta.transformer.wte.weight
    assert not meta.lm_head.weight.is_meta
    assert torch.equal(initial_value("lm_head.weight", meta.lm_head.weight.shape, meta.config, 0),
                       meta.transformer.wte.weight.detach())


def test_pretrained_on_meta_is_a_one_line_error():
    with pytest.raises(GptparError) as config_error:
        load_config(None, ["model.preset=gpt2", "model.init=pretrained", "model.init_device=meta"])
    cfg = load_config(None, ["model.preset=gpt2", "model.init=pretrained"])
    with pytest.raises(GptparError) as build_error:
        build_model(cfg.model, 50257, 0, init_device="meta")
    for error in (config_error, build_error):
        message = str(error.value)
        assert "\n" not in message
        assert "model.init=pretrained" in message and "model.init_device=meta" in message


@pytest.mark.parametrize("name", ["transformer.h.2.attn.c_attn.weight", "transformer.h.0.attn.bias",
                                  "transformer.wte.bias", "h.0.mlp.c_fc.weight", "module.lm_head.weight"])
def test_an_unknown_parameter_name_raises(name: str):
    config = tiny(0, "meta").config  # n_layer=2, so h.2 does not exist
    with pytest.raises(GptparError, match="no initial value is defined for a gpt2 parameter named"):
        initial_value(name, torch.Size([4, 4]), config, 0)
