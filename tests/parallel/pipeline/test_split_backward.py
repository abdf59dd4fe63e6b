"""The zero-bubble schedule's split backward (split_backward.py), in one process on a real pipeline stage: the input
pass B leaves every projection's weight gradient to the weight pass W, and W fills them as one full backward does,
micro-batch after micro-batch, in fp32 and under bf16 autocast (the dtype the forward's matmuls ran in)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gptpar.config import ModelConfig
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.pipeline.engine.split_backward import (
    DeferrableLinear,
    WeightGradStore,
    apply_weight_grads,
    make_deferrable,
)
from gptpar.parallel.pipeline.engine.stages import PipelineStage, pipeline_stages

VOCAB, SEQ, N_LAYER = 64, 8, 2


def _stage() -> PipelineStage:
    """The whole tiny model as one stage: embeddings, blocks, final norm and LM head (first and last at once)."""
    model = build_model(ModelConfig(n_layer=N_LAYER, n_embd=32, n_head=2), VOCAB, seed=0, seq_len=SEQ)
    return pipeline_stages(model, [0], [N_LAYER])[0]


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (2, 3, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(mb[:, :-1], mb[:, 1:]) for mb in tokens]


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_input_pass_leaves_weight_gradients_empty_and_the_weight_pass_fills_them_as_one_backward(
        precision: str) -> None:
    full, split = _stage(), _stage()
    store = WeightGradStore()
    assert make_deferrable(split, store) == 4 * N_LAYER + 1  # c_attn, c_proj, c_fc, mlp.c_proj per block; lm_head
    deferred = {id(m.weight) for m in split.modules() if isinstance(m, DeferrableLinear)}
    deferred |= {id(m.bias) for m in split.modules() if isinstance(m, DeferrableLinear) and m.bias is not None}
    for x, y in _micro_batches():  # one full backward per micro-batch, accumulating, as the other schedules run it
        with _autocast(precision):
            loss = lm_loss(full(x), y)
        loss.backward()
    expected = {n: p.grad for n, p in full.named_parameters()}
    filed = []
    for x, y in _micro_batches():  # B, B, then W, W: ZB-H1's order on a stage with postponed weight passes
        with _autocast(precision):
            loss = lm_loss(split(x), y)
        store.deferring = True
        loss.backward()
        store.deferring = False
        filed.append(store.take())
    params = dict(split.named_parameters())
    assert {n for n, p in params.items() if id(p) in deferred and p.grad is not None} == set()
    for name, param in params.items():  # B computed the rest (norms, embeddings) in full
        if id(param) not in deferred:
            torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0, msg=name)
    for pairs in filed:
        apply_weight_grads(pairs)
    for name, param in params.items():
        assert param.grad.dtype == param.dtype == torch.float32 and not param.grad.requires_grad, name  # as autograd's
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0, msg=name)
