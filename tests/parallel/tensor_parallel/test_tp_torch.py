"""PyTorch's tensor parallelism on GPT-2 (`parallel.tp_impl=torch`) equals one process: logits, loss, every gradient,
the parameters and the clipped gradient norm, with and without sequence and loss parallelism.

One spawn of 2 gloo ranks runs the four cases on a tiny model whose vocabulary (301) does not divide by 2, so its
token table is built padded to 302 rows (no model.pad_vocab padding beyond tp's) and the masking of the padding is
exercised; each rank asserts, and a failing assertion fails spawn_local with its message.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from gloo_pool import GlooPools
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from gptpar.config import ModelConfig
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.tensor_parallel import tensor_parallel_forward
from gptpar.parallel.tensor_parallel.torch_plan import (
    loss_context,
    parallelize_gpt2,
    torch_lm_loss,
    whole_gradients,
    whole_parameters,
)
from gptpar.train.optim import clip_gradients

pytestmark = pytest.mark.slow  # every test here starts processes

VOCAB, TOL = 301, 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (a - b).abs().max().item()
    assert diff <= TOL, f"{what}: differs by {diff:.3g}"


def _check_case(mesh, sp: bool, lp: bool) -> None:
    case = f"sp={sp} lp={lp}"
    model = build_model(ModelConfig(n_layer=2, n_embd=32, n_head=4, pad_vocab=1), VOCAB, 0, seq_len=16, shards=2)
    ref = copy.deepcopy(model)
    parallelize_gpt2(model, mesh, sp, lp)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB - 2, (3, 16), generator=gen)  # token VOCAB - 1 unseen: its row learns from the head
    y = torch.randint(0, VOCAB, (3, 16), generator=gen)

    with loss_context(lp):
        logits = tensor_parallel_forward(model, x)
        loss = torch_lm_loss(logits, y)
        loss.backward()
    ref_logits = ref(x).logits
    ref_loss = lm_loss(ref_logits, y)
    ref_loss.backward()
    assert ref_logits.shape[-1] == 302 and torch.isneginf(ref_logits[..., VOCAB:]).all(), case
    ref_logits = ref_logits[..., :VOCAB]

    if lp:
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), case
        full = logits.full_tensor()
        assert full.shape[-1] == 302 and torch.isneginf(full[..., VOCAB:]).all(), case
        _close(full[..., :VOCAB], ref_logits, f"{case} logits")
    else:
        assert not isinstance(logits, DTensor), case
        _close(logits, ref_logits, f"{case} logits")
    assert not isinstance(loss, DTensor), case
    _close(loss, ref_loss, f"{case} loss")

    params, grads = whole_parameters(model), whole_gradients(model)
    ref_params = dict(ref.named_parameters())
    assert list(params) == list(ref_params) == list(grads), f"{case}: names {list(params)}"
    for name, ref_param in ref_params.items():
        assert torch.equal(params[name], ref_param.detach()), f"{case} {name}: parameter differs"
        _close(grads[name], ref_param.grad, f"{case} {name}.grad")

    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte and isinstance(wte, DTensor), f"{case}: the tie is broken"
    assert grads["transformer.wte.weight"][VOCAB - 1].abs().sum() > 0, f"{case}: no head gradient on wte"
    placements = {p.placements for p in model.parameters()}
    assert all(isinstance(p, DTensor) and p.grad.placements == p.placements for p in model.parameters()), case
    assert {(Shard(0),), (Shard(1),), (Replicate(),)} <= placements, f"{case}: {placements}"

    for max_norm in (math.inf, 0.5):
        norm = clip_gradients(list(model.parameters()), max_norm)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        assert abs(norm - ref_norm) <= TOL, f"{case} max_norm={max_norm}: norm {norm} != {ref_norm}"
    clipped = whole_gradients(model)
    for name, ref_param in ref_params.items():
        _close(clipped[name], ref_param.grad, f"{case} {name}.grad clipped")


def _worker(info: RankInfo) -> None:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (info.world_size,))
    for sp, lp in itertools.product((False, True), repeat=2):
        _check_case(mesh, sp, lp)


def test_torch_tensor_parallel_equals_one_process(gloo_pool: GlooPools) -> None:
    gloo_pool.run(2, _worker)
