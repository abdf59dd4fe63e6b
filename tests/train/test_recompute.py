"""Activation checkpointing and compiled blocks: the same training, less saved memory, the same module tree.

One process: checkpointed blocks give bitwise the plain loss and gradients with dropout on (the recompute replays
the masks), and autograd saves exactly one block input in place of each checkpointed block's activations.
One spawn of 2 ranks: our fsdp (whose hooks gather a block before its recompute) and the pipeline engine with
checkpointing train like one plain process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import make_config, make_trainer, named_params, reference_run, train_steps

from gptpar.config import ModelConfig, ParallelConfig, checkpointed_indices, load_config
from gptpar.errors import GptparError
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.pipeline.one_process.gpt2 import build_parallel_model
from gptpar.parallel.process_group import RankInfo
from gptpar.tensor_bytes import saved_activation_bytes
from gptpar.train.recompute import checkpoint_blocks, compile_blocks, prepare_blocks

TINY = ModelConfig(n_layer=4, n_embd=32, n_head=2, dropout=0.2)
VOCAB, ROWS, SEQ = 300, 4, 16
CPU = torch.device("cpu")


def _tiny(k: int, cfg: ModelConfig = TINY) -> torch.nn.Module:
    model = build_model(cfg, VOCAB, seed=1)
    checkpoint_blocks(model, k)
    return model.train()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))


def _loss_and_grads(model: torch.nn.Module, forward=None) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward from a fixed RNG state (the dropout masks)."""
    x = _ids()
    torch.manual_seed(7)
    logits = (forward or (lambda ids: model(ids).logits))(x)
    loss = lm_loss(logits, x.to(logits.device))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("k", [1, 2])
def test_checkpointed_blocks_give_the_plain_loss_and_gradients_and_keep_every_name(k: int) -> None:
    plain, checkpointed = _tiny(0), _tiny(k)
    assert checkpoint_blocks(build_model(TINY, VOCAB, seed=1), k) == [0, 1, 2, 3][::k]
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [type(m) for m in checkpointed.modules()] == [type(m) for m in plain.modules()]
    loss, grads = _loss_and_grads(checkpointed)
    ref_loss, ref_grads = _loss_and_grads(plain)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


@pytest.mark.parametrize(("mode", "dropout"), [("model_parallel", 0.2), ("pipeline_parallel", 0.0)])
def test_one_process_stage_modes_recompute_inside_their_stages(mode: str, dropout: float) -> None:
    """ModelParallel and Pipe wrap the (checkpointed) blocks in their own stages; training is unchanged."""
    tiny = ModelConfig(n_layer=4, n_embd=32, n_head=2, dropout=dropout)
    pcfg = ParallelConfig(pp_mode=mode, devices="cpu,cpu", chunks=2)
    staged = [build_parallel_model(model, pcfg) for model in (_tiny(0, tiny), _tiny(1, tiny))]
    (ref_loss, ref_grads), (loss, grads) = (_loss_and_grads(net, net) for net in staged)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_pipe_stages_sharing_a_device_with_dropout_are_a_one_line_error(tmp_path: Path) -> None:
    """Pipe's partition threads would draw dropout masks from one generator, which no recompute could replay."""
    cfg = load_config(None, ["train.activation_checkpointing=block", "parallel.pp_mode=pipeline_parallel",
                             "parallel.devices=cpu,cpu", "model.dropout=0.1", f"log.runs_dir={tmp_path}"])
    with pytest.raises(GptparError, match=r"^train.activation_checkpointing=block .*needs a device per stage[^\n]*$"):
        prepare_blocks(build_model(TINY, VOCAB, seed=1, init_device="meta"), cfg, CPU)


def test_checkpointing_saves_one_block_input_in_place_of_each_checkpointed_blocks_activations() -> None:
    """saved(k) = saved(none) - (checkpointed blocks) x (one plain block's saved bytes - its input's bytes)."""
    saved = {}
    for k in (0, 1, 2, 3):
        model = _tiny(k)
        saved[k] = saved_activation_bytes(lambda m=model: m(_ids()), model.parameters())
    hidden = torch.randn(ROWS, SEQ, TINY.n_embd, requires_grad=True)
    block = _tiny(0).transformer.h[1]
    per_block = saved_activation_bytes(lambda: block(hidden), block.parameters()) - hidden.numel() * 4
    assert saved[1] < saved[2] < saved[0]
    for k in (1, 2, 3):
        assert saved[k] == saved[0] - len(checkpointed_indices(TINY.n_layer, k)) * per_block
    assert saved[0] > 10 * saved[1]  # the blocks' activations dominate even this tiny model's


def test_compiled_blocks_train_like_eager_ones_and_keep_every_name() -> None:
    """aot_eager needs no C++ compiler: dynamo traces the (checkpointed) block, autograd's graphs run eagerly."""
    one_layer = ModelConfig(n_layer=1, n_embd=32, n_head=2)
    eager, compiled = _tiny(1, one_layer), _tiny(1, one_layer)
    compile_blocks(compiled, CPU, backend="aot_eager")
    assert list(compiled.state_dict()) == list(eager.state_dict())
    (ref_loss, ref_grads), (loss, grads) = _loss_and_grads(eager), _loss_and_grads(compiled)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_compiler_that_fails_is_a_one_line_error_naming_the_key() -> None:
    def broken(graph, inputs):
        raise RuntimeError("no working C++ compiler found\ndetails")

    with pytest.raises(GptparError,
                       match=r"^train.compile=blocks: .*RuntimeError: no working C\+\+ compiler found\); "):
        compile_blocks(build_model(TINY, VOCAB, seed=1), CPU, backend=broken)


# Two ranks, one spawn: fsdp (on the meta device) and a zero-bubble pipeline, whose B pass recomputes while
# deferring weight gradients. No dropout: the replicas' masks could not match one process's.
CASES = [
    ("fsdp-block", ["parallel.dp=2", "parallel.dp_sync=fsdp", "model.init_device=meta",
                    "train.activation_checkpointing=block"]),
    ("zb1p-k2", ["parallel.pp=2", "parallel.pp_schedule=zb1p", "parallel.chunks=2",
                 "train.activation_checkpointing=2"]),
]


def _worker(info: RankInfo, runs: Path) -> None:
    for name, overrides in CASES:
        trainer = make_trainer(make_config(overrides, runs, name), info)
        record = {"losses": train_steps(trainer, 2), "params": named_params(trainer),
                  "pipeline": trainer.pipeline, "computes_loss": trainer.pipeline and trainer.net.computes_loss}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("recompute")
    gloo_pool.run(2, _worker, runs)
    return runs


@pytest.mark.parametrize("name", [name for name, _ in CASES])
@pytest.mark.slow
def test_checkpointed_ranks_train_like_one_plain_process(results: Path, name: str) -> None:
    overrides = [o for o in dict(CASES)[name] if not o.startswith("train.activation_checkpointing")]
    ref = reference_run(make_config(overrides, results, name))
    ranks = [torch.load(p, weights_only=False) for p in sorted(results.glob(f"{name}.rank*.pt"))]
    assert len(ranks) == 2
    for rank in ranks:
        if rank["pipeline"]:  # every stage reports the pipeline's loss
            assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for param, value in rank["params"].items():
            expected = ref["params"]["transformer.wte.weight" if param == "lm_head.weight" else param]
            torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-4, msg=lambda m, p=param: f"{p}: {m}")
    if not ranks[0]["pipeline"]:  # the replicas' losses average to the one process's
        mean = [sum(pair) / 2 for pair in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
        assert mean == pytest.approx(ref["losses"], rel=1e-5)
