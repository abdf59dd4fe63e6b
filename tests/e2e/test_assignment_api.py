"""The course assignment's API, its own test cases in our words: the names students import behave as the
assignment's tests expect (the GPipe schedule, partitioning, Pipe against the plain model, WithDevice, the GPT-2
wrapper), and `gptpar train --dump-grads` writes the files its two-rank gradient check loads.

The assignment's tests place modules on cuda:0 and cuda:1; here the second device is the meta device where only
partitioning is tested, and the CPU twice (with a balance, to make two partitions) where something runs, unless
two GPUs are visible.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rank_training import BASE, make_config, make_trainer
from torch import nn
from transformers import GPT2Config

from gptpar.config import ConfigError, ModelConfig, load_config
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.pipeline.one_process.gpt2 import gpt2_stages
from gptpar.parallel.process_group import RankInfo
from gptpar.pipeline import GPT2LMHeadModelParallel, GPT2ModelParallel, Pipe, WithDevice, _clock_cycles, _split_module

CPU, META = torch.device("cpu"), torch.device("meta")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
PLACES = [(CPU, META), pytest.param(torch.device("cuda", 0), torch.device("cuda", 1),
                                    marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs"))]


def running_devices() -> tuple[torch.device, torch.device]:
    return (torch.device("cuda", 0), torch.device("cuda", 1)) if TWO_GPUS else (CPU, CPU)


@pytest.mark.parametrize(("m", "n", "gold"), [
    (6, 2, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(4, 0), (3, 1)], [(5, 0), (4, 1)],
            [(5, 1)]]),
    (3, 3, [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)]]),
])
def test_clock_cycles_are_the_assignments_schedules(m: int, n: int, gold: list[list[tuple[int, int]]]) -> None:
    assert [sorted(clock) for clock in _clock_cycles(m, n)] == [sorted(clock) for clock in gold]


@pytest.mark.parametrize(("first", "second"), PLACES)
def test_split_module_cuts_where_the_device_changes(first: torch.device, second: torch.device) -> None:
    model = nn.Sequential(nn.Conv2d(10, 20, 5).to(first), nn.Conv2d(20, 64, 5).to(first),
                          nn.Conv2d(64, 128, 5).to(second))
    partitions, devices = _split_module(model)
    assert len(partitions) == len(devices) == 2
    assert len(partitions[0]) == 2
    assert next(partitions[0].parameters()).device == devices[0] == first
    assert next(partitions[1].parameters()).device == devices[1] == second


@pytest.mark.parametrize(("first", "second"), PLACES)
def test_split_module_places_a_with_device_module_on_its_device(first: torch.device, second: torch.device) -> None:
    model = nn.Sequential(nn.Conv2d(10, 20, 5).to(first), WithDevice(nn.Dropout(0.5), first),
                          nn.Conv2d(20, 64, 5).to(second))
    partitions, devices = _split_module(model)
    assert len(partitions) == len(devices) == 2
    assert isinstance(partitions[0][1], nn.Dropout)
    assert next(partitions[0].parameters()).device == devices[0] == first
    assert next(partitions[1].parameters()).device == devices[1] == second


def test_split_module_flattens_nested_sequentials_into_their_partition() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model = nn.Sequential(inner, WithDevice(nn.Sequential(nn.Tanh(), nn.Sigmoid()), CPU), nn.Linear(2, 2, device=META))
    partitions, devices = _split_module(model)
    assert devices == [CPU, META]
    assert [type(m) for m in partitions[0]] == [nn.Linear, nn.ReLU, nn.Tanh, nn.Sigmoid]
    assert partitions[0][0] is inner[0]  # the original layers, not copies
    assert [type(m) for m in partitions[1]] == [nn.Linear]


def test_with_device_exposes_module_and_device_as_the_assignments_does() -> None:
    inner = nn.Linear(2, 3)
    wrapped = WithDevice(inner, "cpu")
    assert wrapped._module is wrapped.module is inner
    assert wrapped._device == wrapped.device == CPU and isinstance(wrapped._device, torch.device)
    assert list(wrapped.state_dict()) == ["_module.weight", "_module.bias"]
    x = torch.randn(4, 2)
    torch.testing.assert_close(wrapped(x), inner(x))


@pytest.mark.parametrize("batch_size", [1, 16, 32, 64])
@pytest.mark.parametrize("split_size", [1, 2, 4, 8, 16])
def test_pipe_output_equals_the_models_before_it_was_split(batch_size: int, split_size: int) -> None:
    first, second = running_devices()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4).to(first), WithDevice(nn.Sigmoid(), first), nn.Linear(4, 5).to(first),
                          WithDevice(nn.Sigmoid(), first))
    x = torch.randn(batch_size, 3, device=first)
    want = model(x).cpu()
    model[-2] = model[-2].to(second)  # the last two layers move to the second device
    model[-1] = WithDevice(nn.Sigmoid(), second)
    pipe = Pipe(model, split_size=split_size, balance=None if TWO_GPUS else [2, 2])
    assert len(pipe.partitions) == 2
    torch.testing.assert_close(pipe(x).cpu(), want)
    pipe.close()


def test_pipe_split_size_defaults_to_one() -> None:
    assert Pipe(nn.Sequential(nn.Linear(2, 2))).split_size == 1


VOCAB = 256


def tiny_gpt2():
    return build_model(ModelConfig(preset="gpt2-tiny"), VOCAB, seed=7)


def rows_seen(module: nn.Module) -> list[int]:
    """The batch sizes `module` is called with from now on."""
    seen: list[int] = []
    module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(0)))
    return seen


@pytest.mark.parametrize("mode", ["single", "model_parallel", "pipeline_parallel", "both"])
def test_gpt2_wrapper_forward_and_gradients_equal_the_plain_models(mode: str) -> None:
    """`both` is what the assignment's run_pipeline.py does: parallelize(), then _prepare_pipeline_parallel()."""
    x = torch.randint(0, VOCAB, (7, 24), generator=torch.Generator().manual_seed(1))
    plain = tiny_gpt2()
    lm_loss(want := plain(x).logits, x).backward()
    wrapped = GPT2ModelParallel(tiny_gpt2(), devices="cpu,cpu")
    if mode in ("model_parallel", "both"):
        wrapped.parallelize()
    if mode in ("pipeline_parallel", "both"):
        wrapped._prepare_pipeline_parallel(split_size=3)
    assert wrapped.pipeline_parallel == (mode in ("pipeline_parallel", "both"))
    seen = rows_seen(wrapped.model.transformer.h[0])
    got = wrapped(input_ids=x).logits
    assert seen == ([3, 3, 1] if wrapped.pipeline_parallel else [7])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    lm_loss(got, x).backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, param in wrapped.model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert list(wrapped.state_dict()) == [f"model.{k}" for k in plain.state_dict()]  # GPT-2's own keys


def test_gpt2_wrapper_builds_from_a_config_as_the_assignments_does() -> None:
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = GPT2LMHeadModelParallel(config=config, devices="cpu,cpu")
    model._prepare_pipeline_parallel()
    assert model(input_ids=torch.zeros(2, 5, dtype=torch.long)).logits.shape == (2, 5, 100)


def test_staging_a_model_twice_keeps_its_untied_head() -> None:
    """The head is untied when first and last stage differ; a second staging must not copy wte over it again."""
    model = tiny_gpt2()
    gpt2_stages(model, [CPU, META], "layers")
    head = model.lm_head.weight
    assert head is not model.transformer.wte.weight
    gpt2_stages(model, [CPU, META], "layers")
    assert model.lm_head.weight is head


@pytest.mark.parametrize(("overrides", "named"), [
    (["parallel.dp=2", "parallel.dp_sync=zero2"], "parallel.dp_sync=zero2"),
    (["parallel.dp=2", "parallel.dp_sync=fsdp"], "parallel.dp_sync=fsdp"),
    (["parallel.dp=2", "parallel.dp_sync=fsdp2"], "parallel.dp_sync=fsdp2"),
    (["parallel.tp=2"], "parallel.tp=2"),
])
def test_dump_grads_refuses_layouts_that_leave_ranks_pieces_of_the_gradients(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"train.dump_grads saves whole gradients, but {named} leaves"):
        load_config(None, ["train.dump_grads=grads", *overrides])
    load_config(None, ["train.dump_grads=grads", "parallel.dp=2", "parallel.dp_sync=zero1"])  # whole gradients
    load_config(None, ["train.dump_grads=grads", "parallel.dp_sync=fsdp"])  # one replica: nothing sharded


STEPS = 2
SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=CPU)


def single_process_dump(tmp_path: Path, name: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    """Train STEPS steps in this process with train.dump_grads; the dump appears only after the last one."""
    folder = tmp_path / name
    cfg = make_config([*overrides, f"train.max_steps={STEPS}", f"train.dump_grads={folder}"], tmp_path / "runs", name)
    trainer = make_trainer(cfg, SINGLE)
    batches = trainer.batches(0, 0)
    for _ in range(STEPS):
        assert not (folder / "model0_gradients.pth").exists()
        trainer.train_step(next(batches))
        trainer.step += 1
    assert sorted(p.name for p in folder.iterdir()) == ["model0_gradients.pth"]
    return torch.load(folder / "model0_gradients.pth")


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_ranks_dump_the_same_synced_gradients_of_the_last_step(tmp_path: Path) -> None:
    """`gptpar train parallel.dp=2 --dump-grads DIR`, then the assignment's check. The files must also equal one
    process's on the same global batch: a dump before the sync holds each rank's own gradient, one after
    zeroing holds zeros (the reference is checked to have none)."""
    out = subprocess.run([sys.executable, "-m", "gptpar", "train", *BASE, "parallel.dp=2", f"train.max_steps={STEPS}",
                          "train.eval_every=0", "log.progress=none", f"log.runs_dir={tmp_path / 'runs'}",
                          "log.run_id=dp2", "--dump-grads", "grads"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    folder = tmp_path / "grads"  # relative to where gptpar was run, although ranks run in the run folder
    assert sorted(p.name for p in folder.iterdir()) == ["model0_gradients.pth", "model1_gradients.pth"]

    # The assignment's test_gradient_accumulation, as it loads and compares the two files.
    weight0 = torch.load(folder / "model0_gradients.pth")
    weight1 = torch.load(folder / "model1_gradients.pth")
    assert len(weight0) == len(weight1)
    assert weight0.keys() == weight1.keys()
    for key in weight0:
        assert torch.sum(weight0[key] != weight1[key]) == 0, f"No sync on gradient {key}"

    reference = single_process_dump(tmp_path, "single", [])
    assert all(torch.count_nonzero(grad) > 0 for grad in reference.values())
    # GPT2LMHeadModel's names (BASE keeps gpt2-tiny's 4 blocks), the tied head once, as wte.
    names = [n for n, _ in tiny_gpt2().named_parameters()]
    assert list(reference) == names and "lm_head.weight" not in reference
    assert_same_gradients(weight0, reference)


def test_a_one_process_pipeline_dumps_under_gpt2_names(tmp_path: Path) -> None:
    reference = single_process_dump(tmp_path, "single", [])
    piped = single_process_dump(tmp_path, "piped", ["parallel.pp_mode=pipeline_parallel", "parallel.devices=cpu,cpu",
                                                    "parallel.chunks=2"])
    assert_same_gradients(piped, reference)
