"""LoRA (train.lora_rank) in one process: the adapters start from the run seed by name (B zeros, A drawn per name,
the same on the meta device), only they (and ViT's classifier) train, the training state is its closed form counted by
hand, a resumed run goes on exactly, the export loads through peft and transformers with the trained model's logits,
and bad input is one line. Data parallelism: test_lora_ranks.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from rank_training import BASE, VIT_BASE, make_config, make_trainer, named_params, resumed_run, train_steps
from transformers import AutoModelForCausalLM, ViTForImageClassification

from gptpar.cli import main
from gptpar.config import ModelConfig, TrainConfig, load_config
from gptpar.errors import ConfigError, GptparError
from gptpar.models import find_model
from gptpar.models.build import add_lora, build_model, materialize, parameter_seed
from gptpar.models.lora import adapter_part
from gptpar.parallel.process_group import RankInfo
from gptpar.train.checkpoint import export_lora

ONE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
               launcher="single", backend="gloo", device=torch.device("cpu"))
RANK = 4
LORA = [f"train.lora_rank={RANK}", "train.lora_alpha=8", "train.activation_checkpointing=block"]
VOCAB = 64


def _adapted(preset: str, seed: int = 0, init_device: str = "cpu") -> torch.nn.Module:
    shape = ModelConfig(preset=preset, n_layer=2, n_embd=16, n_head=2, n_kv_head=1)
    model = build_model(shape, VOCAB, seed, init_device=init_device)
    return add_lora(model, TrainConfig(lora_rank=RANK), seed)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_adapters_start_from_the_run_seed_by_name_on_any_device(preset: str) -> None:
    """B is zeros, A uniform in +-1/sqrt(in) from the generator of (seed, its name): the same in two builds, on the
    meta device materialised, and another seed draws another A; everything else is frozen."""
    model = _adapted(preset)
    again, meta = _adapted(preset), _adapted(preset, init_device="meta")
    materialize(meta, 0, torch.device("cpu"))
    other = dict(_adapted(preset, seed=1).named_parameters())
    params = dict(model.named_parameters())
    adapters = {name: p for name, p in params.items() if adapter_part(name)}
    assert adapters and all(p.requires_grad == (name in adapters) for name, p in params.items())
    for name, p in adapters.items():
        if adapter_part(name) == "B":
            assert not p.any(), name
            continue
        bound = 1 / math.sqrt(p.shape[1])
        generator = torch.Generator().manual_seed(parameter_seed(0, name))
        assert torch.equal(p, torch.empty(p.shape).uniform_(-bound, bound, generator=generator)), name
        assert not torch.equal(p, other[name]), name
    for name, p in [*again.named_parameters(), *meta.named_parameters()]:
        assert torch.equal(p, params[name]), name


def _trainer(tmp_path: Path, name: str, extra: list[str] = ()) -> object:
    return make_trainer(make_config([*LORA, *extra], tmp_path, name), ONE)


GQA = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32)}  # llama-tiny, 1 KV head
VIT = {name: (64, 64) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}  # vit-tiny: width 64, 2 layers


@pytest.mark.parametrize("base, layers, targets, whole", [
    ([*BASE, "model.preset=gpt2-tiny"], 4, {"attn.c_attn": (32, 96), "attn.c_proj": (32, 32)}, {}),
    ([*BASE, "model.preset=llama-tiny", "model.n_kv_head=1"], 4, GQA, {}),
    (VIT_BASE, 2, VIT, {"classifier.weight": 10 * 64, "classifier.bias": 10}),  # a head of the set's 10 classes
], ids=["gpt2-tiny", "llama-tiny", "vit-tiny"])
def test_only_the_adapters_train_and_the_state_is_the_closed_form(tmp_path: Path, base: list[str], layers: int,
                                                                  targets: dict[str, tuple[int, int]],
                                                                  whole: dict[str, int]) -> None:
    """Each adapted layer of (in, out) adds r * (in + out) trainable parameters in each of the model's `layers`
    blocks, and the `whole` parameters (ViT's new classifier) train beside them; the state is 4 bytes per parameter
    plus 12 per trainable one (its gradient and AdamW's two moments)."""
    trainer = make_trainer(make_config(LORA, tmp_path, "run", base), ONE)
    trainable = layers * sum(RANK * (i + o) for i, o in targets.values()) + sum(whole.values())
    before = named_params(trainer)
    train_steps(trainer, 2)
    after = named_params(trainer)
    moved = {name for name in after if not torch.equal(after[name], before[name])}
    assert moved == {name for name in after if adapter_part(name) or name in whole}  # they all moved, nothing else
    memory, n = trainer.memory, trainer.n_params
    assert (memory["params"], memory["trainable"]) == (n, trainable)
    assert (memory["params_bytes"], memory["grads_bytes"], memory["optimizer_bytes"]) == (4 * n, 4 * trainable,
                                                                                           8 * trainable)
    assert trainer.lora()["state_bytes"] == 4 * n + 12 * trainable
    assert f"LoRA rank {RANK} on {', '.join(targets)}: {trainable:,} parameters train" in trainer.banner()


def test_checkpointed_blocks_train_the_adapters_as_kept_activations_do(tmp_path: Path) -> None:
    kept = _trainer(tmp_path, "kept", ["train.activation_checkpointing=none"])
    recomputed = _trainer(tmp_path, "recomputed")
    assert train_steps(kept, 2) == train_steps(recomputed, 2)  # the recompute runs the same kernels: bitwise
    assert all(torch.equal(named_params(recomputed)[name], value) for name, value in named_params(kept).items())


def test_a_resumed_lora_run_continues_bitwise_where_it_stopped(tmp_path: Path) -> None:
    straight = _trainer(tmp_path, "straight")
    losses = train_steps(straight, 2)
    resumed = resumed_run(make_config(LORA, tmp_path, "resumed"), ONE)
    assert resumed["losses"] == [losses[1]]
    for name, value in named_params(straight).items():
        assert torch.equal(resumed["params"][name], value), name


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("preset", ["gpt2-tiny", "qwen2-tiny"])
def test_the_export_loads_through_peft_and_transformers_with_the_trained_logits(tmp_path: Path, preset: str) -> None:
    """The adapter folder onto the run's base model (peft), and the merged folder alone (transformers), give the
    trained model's logits over the tokenizer's vocabulary (the token table is padded past it in training)."""
    cfg = make_config([*LORA, f"model.preset={preset}", "train.lr=0.05"], tmp_path, "run")
    trainer = make_trainer(cfg, ONE)
    trainer.folder.write_config(cfg)
    train_steps(trainer, 3)
    trainer.checkpoints.save()
    trainer.net.eval()
    tokens = torch.randint(0, trainer.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    trained = _logits(find_model(trainer.net), tokens)[..., :trainer.vocab_size]
    base = build_model(dataclasses.replace(cfg.model, pad_vocab=1), trainer.vocab_size, cfg.train.seed)
    adapter = PeftModel.from_pretrained(base, export_lora(trainer.folder.path, tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(export_lora(trainer.folder.path, tmp_path / "merged", merge=True))
    untrained = _logits(build_model(dataclasses.replace(cfg.model, pad_vocab=1), trainer.vocab_size, 1337), tokens)
    assert (trained - untrained).abs().max() > 1e-3  # the adapters moved the logits: the check below means something
    for loaded in (adapter, merged.eval()):
        # measured: 0 through peft, 2.8e-7 merged (of logits up to 0.44: a merged weight rounds once more)
        torch.testing.assert_close(_logits(loaded, tokens), trained, rtol=0, atol=1e-6)


def test_a_vit_export_carries_its_trained_classifier_through_peft_and_transformers(tmp_path: Path) -> None:
    """peft's adapter folder names the classifier in modules_to_save and holds its trained weights, so loaded onto a
    freshly built ViT of the run's seed (whose classifier is the untrained one) it gives the trained model's logits;
    the merged folder loads alone into ViTForImageClassification with them too."""
    cfg = make_config([*LORA, "train.lr=0.05"], tmp_path, "run", VIT_BASE)
    trainer = make_trainer(cfg, ONE)
    trainer.folder.write_config(cfg)
    train_steps(trainer, 3)
    trainer.checkpoints.save()
    trainer.net.eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    trained = _logits(find_model(trainer.net), images)
    adapter = export_lora(trainer.folder.path, tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["classifier"]
    fresh = build_model(cfg.model, trainer.vocab_size, cfg.train.seed)
    assert (trained - _logits(fresh, images)).abs().max() > 1e-3  # training moved the logits: the checks mean something
    merged = export_lora(trainer.folder.path, tmp_path / "merged", merge=True)
    for loaded in (PeftModel.from_pretrained(fresh, adapter), ViTForImageClassification.from_pretrained(merged)):
        # measured: 0 through peft, 2.4e-7 merged (of logits up to 2.7: a merged weight rounds once more)
        torch.testing.assert_close(_logits(loaded.eval(), images), trained, rtol=0, atol=1e-6)


def test_merge_of_a_run_without_lora_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = make_config([], tmp_path, "plain")
    trainer = make_trainer(cfg, ONE)
    trainer.folder.write_config(cfg)
    trainer.checkpoints.save()
    assert main(["checkpoint", "export", str(trainer.folder.path), "--merge"]) != 0
    err = capsys.readouterr().err.strip()
    assert "train.lora_rank=0" in err and "without --merge" in err and len(err.splitlines()) == 1


def test_a_target_that_matches_no_module_names_those_there_are() -> None:
    model = build_model(ModelConfig(preset="gpt2-tiny", n_layer=1, n_embd=16, n_head=2), VOCAB, 0)
    with pytest.raises(GptparError) as caught:
        add_lora(model, TrainConfig(lora_rank=2, lora_targets="attn.c_attn, q_proj"), 0)
    assert str(caught.value) == ("train.lora_targets: 'q_proj' matches no module of this GPT-2; its layers are named "
                                 "c_attn, c_fc, c_proj, lm_head, wpe, wte (a dotted tail such as attn.c_proj picks one "
                                 "of a name's kinds)")


def test_a_target_peft_cannot_adapt_is_one_line() -> None:
    model = build_model(ModelConfig(preset="gpt2-tiny", n_layer=1, n_embd=16, n_head=2), VOCAB, 0)
    with pytest.raises(GptparError, match=r"^train.lora_targets=ln_1: peft cannot adapt them \(.*\); name linear "
                                          r"layers$"):
        add_lora(model, TrainConfig(lora_rank=2, lora_targets="ln_1"), 0)


@pytest.mark.parametrize("layout, named", [
    (["parallel.pp=2"], "parallel.pp=2"), (["parallel.tp=2"], "parallel.tp=2"),
    (["model.preset=mixtral-tiny", "parallel.dp=2", "parallel.ep=2"], "parallel.ep=2"),
    (["parallel.pp_mode=model_parallel", "parallel.devices=cpu,cpu"], "parallel.pp_mode=model_parallel"),
])
def test_lora_with_a_layout_that_cuts_the_model_is_one_line(layout: list[str], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.lora_rank=8", *layout])
    assert str(caught.value) == (f"train.lora_rank=8 runs on one process or data parallelism only, not with {named}; "
                                 "set parallel.pp, tp and ep to 1 and parallel.pp_mode=single, or train.lora_rank=0")


def test_lora_under_our_fsdp_is_one_line_naming_the_strategies_that_run_it() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.lora_rank=8", "parallel.dp=2", "parallel.dp_sync=fsdp"])
    assert str(caught.value) == ("train.lora_rank=8 does not run under parallel.dp_sync=fsdp (its units shard "
                                 "trainable parameters only, and a unit of frozen weights alone has none); use naive, "
                                 "bucketed, ddp, zero1, zero2 or fsdp2")


def test_lora_under_deepspeed_is_refused_even_on_one_device() -> None:
    """DeepSpeed runs alone at parallel.dp=1 (a group of one), so its refusal must not wait for dp > 1."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.lora_rank=8", "parallel.dp_sync=deepspeed"])
    assert str(caught.value).startswith("train.lora_rank=8 does not run under parallel.dp_sync=deepspeed (")
