"""GPT-2 in model-parallel and pipeline-parallel modes matches the plain model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gptpar.config import ModelConfig, ParallelConfig
from gptpar.errors import GptparError
from gptpar.models.build import build_model
from gptpar.models.gpt2 import Block
from gptpar.models.loss import lm_loss
from gptpar.parallel.pipeline.cuts import stage_sizes, untie_lm_head
from gptpar.parallel.pipeline.one_process.gpt2 import gpt2_stages
from gptpar.pipeline import build_parallel_model, input_device, output_device, resolve_devices

VOCAB = 256


def tiny(attn: str = "sdpa"):
    model = build_model(ModelConfig(preset="gpt2-tiny"), VOCAB, seed=7)
    model.config._attn_implementation = attn
    return model


def batch(rows: int = 7, seq: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(module: nn.Module, owner: nn.Module, x, y) -> tuple[torch.Tensor, dict, torch.Tensor]:
    logits = module(x)
    loss = lm_loss(logits, y)
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in owner.named_parameters()}, loss.detach()


@pytest.mark.parametrize(("mode", "chunks"), [("model_parallel", 1), ("pipeline_parallel", 3),
                                              ("pipeline_parallel", 8)])
def test_parallel_modes_match_single(mode: str, chunks: int) -> None:
    x, y = batch()
    ref = tiny()
    want_logits, want_grads, want_loss = loss_and_grads(lambda t: ref(t).logits, ref, x, y)
    model = tiny()
    par = build_parallel_model(model, ParallelConfig(pp_mode=mode, devices="cpu,cpu", chunks=chunks))
    assert par.input_device == par.output_device == torch.device("cpu")
    logits, grads, loss = loss_and_grads(par, model, x, y)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_single_mode_is_the_plain_model() -> None:
    x, _ = batch()
    model = tiny()
    par = build_parallel_model(model, ParallelConfig(pp_mode="single", devices=""))
    torch.testing.assert_close(par(x), model(x).logits)


def test_wrapper_exposes_the_original_parameters_and_checkpoints_round_trip() -> None:
    model = tiny()
    par = build_parallel_model(model, ParallelConfig(pp_mode="pipeline_parallel", devices="cpu,cpu"))
    assert {id(p) for p in par.parameters()} == {id(p) for p in model.parameters()}
    assert model.lm_head.weight is model.transformer.wte.weight  # same device: tie kept
    x, _ = batch()
    before = par(x).detach()
    fresh = tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.load_state_dict(fresh.state_dict())  # the original model's checkpoint format still works
    torch.testing.assert_close(par(x), fresh(x).logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(before, fresh(x).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_blocks_without_a_mask_stay_causal(attn: str) -> None:
    """Changing a later token must not move any earlier logit."""
    x, _ = batch(rows=2)
    model = tiny(attn)
    par = build_parallel_model(model, ParallelConfig(pp_mode="pipeline_parallel", devices="cpu,cpu"))
    with torch.no_grad():
        torch.testing.assert_close(par(x), tiny()(x).logits, rtol=1e-4, atol=1e-5)
        changed = x.clone()
        changed[:, -1] = (changed[:, -1] + 1) % VOCAB
        a, b = par(x), par(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


class TupleBlock(nn.Module):
    """What GPT2Block returned before transformers 5."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden, attention_mask=None):
        return (self.block(hidden, attention_mask=attention_mask), None)


def test_block_carries_hidden_states_from_tuple_returning_blocks() -> None:
    inner = tiny().transformer.h[0]
    h = torch.randn(2, 5, 128)
    torch.testing.assert_close(Block(TupleBlock(inner), True)(h), Block(inner, True)(h))


def test_untied_head_keeps_logits_and_splits_the_shared_gradient() -> None:
    x, y = batch()
    ref = tiny()
    _, want, _ = loss_and_grads(lambda t: ref(t).logits, ref, x, y)
    model = tiny()
    untie_lm_head(model)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert not model.config.tie_word_embeddings
    logits, _, _ = loss_and_grads(lambda t: model(t).logits, model, x, y)
    torch.testing.assert_close(logits, ref(x).logits.detach())
    both = model.transformer.wte.weight.grad + model.lm_head.weight.grad
    torch.testing.assert_close(both, want["transformer.wte.weight"], rtol=1e-4, atol=1e-6)


def test_stage_sizes_balance_layers_and_parameters() -> None:
    assert stage_sizes([1] * 4, 2) == [2, 2]
    assert stage_sizes([1] * 5, 2) == [3, 2]  # the head's stage gets fewer blocks on a tie
    assert stage_sizes([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert stage_sizes([1] * 6, 3, first=0, last=3) == [3, 2, 1]
    assert stage_sizes([1] * 4, 4) == [1, 1, 1, 1]


@pytest.mark.parametrize(("balance", "blocks"), [("layers", [2, 1, 1]), ("params", [1, 2, 1])])
def test_gpt2_stages_put_embeddings_first_and_head_last(balance: str, blocks: list[int]) -> None:
    """By parameters, the embeddings' weight on stage 0 moves a block off it."""
    seq, per_stage = gpt2_stages(tiny(), [torch.device("cpu")] * 3, balance)
    assert per_stage == [blocks[0] + 1, blocks[1], blocks[2] + 1]
    assert [type(m).__name__ for m in seq] == ["Embedding", "Block", "Block", "Block", "Block", "Head"]


def test_more_stages_than_layers_is_an_error() -> None:
    with pytest.raises(GptparError, match="5 stages but the model has only 4"):
        build_parallel_model(tiny(), ParallelConfig(pp_mode="model_parallel", devices="cpu,cpu,cpu,cpu,cpu"))


def test_device_list_parsing_and_errors() -> None:
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_devices(" cpu , cpu ") == [torch.device("cpu")] * 2
    if visible == 0:
        assert resolve_devices("") == [torch.device("cpu")]
    with pytest.raises(GptparError, match=rf"parallel.devices='cpu,cuda:{visible}'.*{visible} GPU"):
        resolve_devices(f"cpu,cuda:{visible}")
    with pytest.raises(GptparError, match="parallel.devices='gpu0'"):
        resolve_devices("gpu0")


def test_input_and_output_device_look_through_wrappers() -> None:
    par = build_parallel_model(tiny(), ParallelConfig(pp_mode="model_parallel", devices="cpu,cpu"))

    class Wrapper(nn.Module):  # the shape of DistributedDataParallel
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    assert input_device(Wrapper(par)) == output_device(par) == torch.device("cpu")
