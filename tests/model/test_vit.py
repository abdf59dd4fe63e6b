"""ViT image classification (data.task=classify): the presets' sizes against transformers' own count, the seeded
build, the embedded image set, the accuracy summed over replicas, the config's one-line refusals, training that learns
in one process, and (slow) every data-parallel strategy on two ranks equal to one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import GlooPools
from rank_training import (
    VIT_BASE,
    assert_resumed_bitwise,
    assert_trains_like_one_process,
    make_config,
    make_trainer,
    named_params,
    reference_run,
    resumed_run,
    saved_ranks,
    train_steps,
)
from thread_ranks import run_threads

from gptpar.config import ConfigError, DataConfig, ModelConfig, load_config, to_yaml
from gptpar.data.images import load_images
from gptpar.errors import GptparError
from gptpar.models.build import build_model, count_params, empty_model, materialize, model_config
from gptpar.parallel.process_group import RankInfo
from gptpar.plan.layout import layout_of
from gptpar.presets import PRESETS
from gptpar.run.folder import CONFIG_FILE
from gptpar.run.logfile import format_record, rank_log_path
from gptpar.train.checkpoint import export_checkpoint
from gptpar.train.classify import Accuracy

SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=torch.device("cpu"))


@pytest.mark.parametrize(("preset", "classes", "published"), [
    ("vit-tiny", 10, None), ("vit-base", 1000, 86_567_656), ("vit-huge", 1000, 632_045_800)])
def test_the_presets_closed_form_is_transformers_own_count(preset: str, classes: int, published: int | None) -> None:
    """ViT-B/16 is 86.6M and ViT-H/14 632M with ImageNet's 1000 classes; built on the meta device (no memory)."""
    model = empty_model(model_config(ModelConfig(preset=preset), classes))
    assert count_params(model) == PRESETS[preset].parameters(classes) == (published or count_params(model))
    assert next(model.parameters()).is_meta


def test_a_meta_build_materialises_to_the_cpu_build_as_the_init_table_says() -> None:
    cpu = build_model(ModelConfig(preset="vit-tiny"), 10, seed=3)
    meta = build_model(ModelConfig(preset="vit-tiny"), 10, seed=3, init_device="meta")
    materialize(meta, 3, torch.device("cpu"))
    for (name, a), b in zip(cpu.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(cpu.classifier.weight, build_model(ModelConfig(preset="vit-tiny"), 10, 4).classifier.weight)
    assert torch.equal(cpu.classifier.bias, torch.zeros(10))
    assert torch.equal(cpu.vit.layers[1].layernorm_after.weight, torch.ones(64))
    assert cpu.vit.layers[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)  # 16,384 draws: 1 sigma 0.6%


def test_a_save_pretrained_vit_folder_loads_its_weights_and_refuses_other_classes(tmp_path: Path) -> None:
    """A ViT folder has no tokenizer: the config takes it without one, and the classifier must fit the data."""
    saved = build_model(ModelConfig(preset="vit-tiny"), 10, seed=5)
    saved.save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.init=pretrained:{tmp_path}", "data.task=classify", "data.source=synthetic"])
    assert cfg.model.shape().parameters(10) == PRESETS["vit-tiny"].parameters(10)  # the folder fixes the shape
    loaded = build_model(cfg.model, 10, seed=0)
    for (name, a), b in zip(saved.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(GptparError, match="its classifier has 10 classes and the data 7; train on a data set of 10"):
        build_model(cfg.model, 7, seed=0)


def test_the_embedded_images_are_seeded_sized_and_labelled_by_class() -> None:
    data = load_images(DataConfig(task="classify", source="synthetic", synthetic_images=50, synthetic_classes=5,
                                  val_fraction=0.2), 16)
    assert (len(data.train), len(data.val), len(data.classes)) == (40, 10, 5)
    image, label = data.train[7]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and label.shape == () and label.item() == 7 % 5
    again = load_images(DataConfig(task="classify", source="synthetic", synthetic_images=50, synthetic_classes=5,
                                   val_fraction=0.2), 16)
    assert torch.equal(again.train[7][0], image)
    assert not torch.equal(data.val[0][0], data.train[0][0])  # validation images are other draws
    with pytest.raises(IndexError):
        data.val[10]


def _accuracy_on_threads(classes: int, logits: list[torch.Tensor], labels: list[torch.Tensor]) -> list[dict]:
    """Each thread rank observes its own batch; the accuracy is summed over the real gloo group."""
    def rank_main(rank: int) -> dict:
        accuracy = Accuracy(classes, lambda t: (dist.all_reduce(t), t)[1], torch.device("cpu"))
        accuracy.reset()
        accuracy.observe(logits[rank], labels[rank])
        return accuracy.scores()
    return run_threads(2, rank_main)


def test_accuracy_counts_every_replicas_images_once() -> None:
    """Shards of 1 and 3 images: the replicas' counts are summed (a mean of their ratios would say 0.5 + ...)."""
    logits = [torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[3.0, 0.0, 1.0], [0.0, 2.0, 1.0], [1.0, 0.0, 2.0]])]
    labels = [torch.tensor([2]), torch.tensor([0, 0, 2])]
    assert _accuracy_on_threads(3, logits, labels) == [{"accuracy": 0.75}] * 2  # 3 of 4 images
    hundred = [torch.arange(100.0)[None].repeat(2, 1), torch.arange(100.0)[None]]  # class 99 first, then 98, ...
    scores = _accuracy_on_threads(100, hundred, [torch.tensor([99, 95]), torch.tensor([94])])
    assert scores == [{"accuracy": pytest.approx(1 / 3), "accuracy_top5": pytest.approx(2 / 3)}] * 2


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.task=classify", "data.source=synthetic"],
     "data.task=classify trains an image classifier; model.arch=gpt2 (model.preset=gpt2-tiny) is a language model; "
     "use model.preset=vit-tiny or vit-base or vit-huge"),
    (["model.preset=vit-tiny"], "model.arch=vit classifies images; data.task=lm is a language task; use "
     "data.task=classify"),
    (["model.preset=vit-tiny", "data.task=classify", "data.source=synthetic", "model.image_size=30"],
     "model.image_size=30 is not a multiple of the 8-pixel patches of model.preset=vit-tiny; use a multiple of 8"),
    (["model.preset=vit-tiny", "data.task=classify"],
     "data.source='stdlib' is not an image source; data.task=classify reads synthetic"),
    (["model.preset=vit-tiny", "data.task=classify", "data.source=synthetic", "parallel.tp=2"],
     "parallel.tp=2 with model.arch=vit is not built: an image classifier runs whole on each rank, under data "
     "parallelism (parallel.dp, any parallel.dp_sync); use parallel.tp=1"),
    (["model.preset=vit-tiny", "data.task=classify", "data.source=synthetic", "parallel.pp=2"],
     "parallel.pp=2 with model.arch=vit is not built"),
    (["model.preset=vit-tiny", "data.task=classify", "data.source=synthetic", "parallel.ep=2", "parallel.dp=2"],
     "parallel.ep=2 splits a mixture's experts; vit has none"),
    (["model.arch=vit", "data.task=classify", "data.source=synthetic"],
     "model.arch=vit needs an image preset: model.preset=gpt2-tiny has no image or patch size"),
    (["model.preset=vit-tiny", "data.task=classify", "data.source=synthetic", "train.loss_kernel=chunked"],
     "train.loss_kernel=chunked chooses a language model's cross-entropy"),
])
def test_a_classify_config_that_cannot_run_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_vit_tiny_learns_the_embedded_set_and_logs_its_accuracy(tmp_path: Path) -> None:
    """24 steps of 32 images: top-1 validation accuracy well above chance (0.1); measured 0.67 at step 24. The eval
    and epoch records carry it."""
    cfg = make_config(["data.synthetic_images=1000", "train.batch_size=32", "train.lr=0.002", "train.max_steps=24",
                       "train.eval_every=12", "train.eval_batches=4"], tmp_path, "learns", VIT_BASE)
    trainer = make_trainer(cfg, SINGLE)
    assert "ViT of 114,250 parameters (2 layers, width 64, 4 heads); 10 classes of 32-pixel images;" in trainer.banner()
    assert (trainer.fast_path()["loss"], trainer.fast_path()["vocab_rows"]) == ("plain", 10)
    status, _ = trainer.run()
    records = [json.loads(line) for line in rank_log_path(trainer.folder.path, 0).read_text().splitlines()]
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    (epoch,) = [r for r in records if r["kind"] == "epoch"]
    assert status == "completed" and sorted(evals) == [12, 24]
    assert evals[24]["accuracy"] > 0.4 and "accuracy_top5" not in evals[24]  # 10 classes: top-1 only
    assert epoch["accuracy"] == evals[24]["accuracy"]
    # a step's tokens are its images' patches and class tokens: 32 x (16 + 1)
    assert {r["tokens"] for r in records if r["kind"] == "step"} == {32 * 17}
    (memory,) = [r for r in records if r["kind"] == "memory"]  # the planner counts the model the run built
    assert memory["params"] == layout_of(cfg).rank_parameters(0) == 114_250
    assert format_record(evals[24]).endswith(f"accuracy {evals[24]['accuracy']:.2f}")  # as `gptpar logs` shows it


# --- every data-parallel strategy on two ranks: one process's training (slow: spawns ranks) -------------------------
CASES = [(sync, ["parallel.dp=2", f"parallel.dp_sync={sync}"])
         for sync in ("naive", "bucketed", "ddp", "zero1", "zero2", "fsdp", "fsdp2")]
CASES += [("fsdp-meta", ["parallel.dp=2", "parallel.dp_sync=fsdp", "model.init_device=meta"]),
          ("fsdp2-meta", ["parallel.dp=2", "parallel.dp_sync=fsdp2", "model.init_device=meta"]),
          ("zero2-accum", ["parallel.dp=2", "parallel.dp_sync=zero2", "train.grad_accum=2"]),
          ("fsdp2-checkpointed", ["parallel.dp=2", "parallel.dp_sync=fsdp2", "train.activation_checkpointing=block"]),
          ("ddp-checkpointed", ["parallel.dp=2", "parallel.dp_sync=ddp", "train.activation_checkpointing=block"]),
          ("zero2-bf16", ["parallel.dp=2", "parallel.dp_sync=zero2", "train.precision=bf16"]),
          ("fsdp2-bf16", ["parallel.dp=2", "parallel.dp_sync=fsdp2", "train.precision=bf16"])]
# bf16 against one bf16 process: tests/train/test_precision.py's GPT-2 tolerances (losses within 1e-3, parameters
# within a mean |difference| of 3e-4 after two AdamW steps at lr 0.01).
BF16_LOSS_TOL, BF16_PARAM_TOL = 1e-3, 3e-4
RESUMED = ["zero2", "fsdp2"]


def _vit_worker(info: RankInfo, runs: Path) -> None:
    for name, overrides in CASES:
        trainer = make_trainer(make_config(overrides, runs, name, VIT_BASE), info)
        record = {"losses": train_steps(trainer, 2), "params": named_params(trainer),
                  "coords": dict(trainer.dims.coords), "val": trainer.evaluate(), "scores": trainer.val_scores.scores()}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")
    for name in RESUMED:  # a step, a checkpoint, a new trainer, a step
        resumed = resumed_run(make_config(dict(CASES)[name], runs, f"resumed-{name}", VIT_BASE), info)
        torch.save(resumed, runs / f"resumed-{name}.rank{info.rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("vit")
    gloo_pool.run(2, _vit_worker, runs)
    return runs


@pytest.mark.parametrize("name", [name for name, _ in CASES])
@pytest.mark.slow
def test_vit_under_each_strategy_trains_like_one_process(results: Path, name: str) -> None:
    """GPT-2's tolerances (rank_training: losses rel 1e-5, parameters 1e-4); the accuracy is the same count."""
    ranks = saved_ranks(results, name)
    cfg = make_config(dict(CASES)[name], results, name, VIT_BASE)
    ref = reference_run(cfg)
    assert ref["scores"]["accuracy"] is not None
    if name.endswith("-bf16"):
        losses = [sum(step) / 2 for step in zip(*(r["losses"] for r in ranks), strict=True)]
        assert losses == pytest.approx(ref["losses"], abs=BF16_LOSS_TOL)
        diff = torch.cat([(value - ref["params"][p]).flatten() for p, value in ranks[0]["params"].items()])
        assert diff.abs().mean() < BF16_PARAM_TOL
        return
    assert_trains_like_one_process(ref, ranks, "", name)
    assert all(rank["scores"] == ref["scores"] for rank in ranks)


@pytest.mark.parametrize("name", RESUMED)
@pytest.mark.slow
def test_a_resumed_vit_continues_bitwise_and_exports_under_its_own_names(results: Path, name: str,
                                                                         tmp_path: Path) -> None:
    """Each rank's shards saved and loaded back continue as the run that never stopped; `gptpar checkpoint export`
    writes the whole model under ViTForImageClassification's names, which it loads."""
    assert_resumed_bitwise(results, name)
    run = results / f"resumed-{name}"  # its config, as `gptpar train` writes it: export reads the architecture there
    (run / CONFIG_FILE).write_text(to_yaml(make_config(dict(CASES)[name], results, f"resumed-{name}", VIT_BASE)))
    exported = torch.load(export_checkpoint(run, tmp_path / "plain.pt"), weights_only=False)
    model = empty_model(model_config(ModelConfig(preset="vit-tiny"), 10))
    model.load_state_dict(exported["vit"], assign=True)
    for param, value in saved_ranks(results, f"resumed-{name}")[0]["saved"].items():
        assert torch.equal(model.get_parameter(param), value), param


@pytest.mark.slow  # dynamo traces the model: ~20 s on a loaded CPU
def test_compiled_vit_trains_as_the_eager_model(tmp_path: Path) -> None:
    """train.compile=model and blocks (aot_eager: no C++ compiler needed) find ViT's blocks through its description
    and train as the eager model at test_compile.py's GPT-2 tolerances."""
    eager = make_trainer(make_config(["train.compile=false"], tmp_path, "eager", VIT_BASE), SINGLE)
    losses, params = train_steps(eager, 2), named_params(eager)
    for mode in ("model", "blocks"):
        compiled = make_trainer(make_config([f"train.compile={mode}", "train.compile_backend=aot_eager"], tmp_path,
                                            mode, VIT_BASE), SINGLE)
        assert compiled.fast_path()["compile"] == mode
        assert train_steps(compiled, 2) == pytest.approx(losses, rel=1e-5), mode
        for name, value in named_params(compiled).items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
