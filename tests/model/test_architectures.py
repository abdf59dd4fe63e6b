"""The Llama family beside GPT-2: each architecture described once (gptpar/models) and trained by every
data-parallel strategy, the pipeline engine and tensor parallelism exactly as one process trains it, on language
modelling and on instruction tuning (data.task=sft).

In-process: the presets' parameter counts are their closed forms, the pipeline's pieces compute the model's own
logits, a meta build materialises to a CPU build (rotary tables included), bad shapes are one line. On the shared
gloo pool: qwen2-tiny (q/k/v biases, a tied head) under every data-parallel strategy, deferred initialisation, the
pipeline engine's schedules, tensor parallelism (ours and torch's, with sequence and loss parallelism) and their
compositions DP x PP, DP x TP, PP x TP, PP x TP x DP, and under sft; llama-tiny (no biases, an untied head) under
fsdp2, tensor parallelism and the pipeline.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import assert_trains_like_one_process, make_config, reference_run, save_cases, saved_ranks

from gptpar.architectures import ARCHITECTURES, ROWS, ArchitectureRow
from gptpar.config import ConfigError, load_config
from gptpar.models import architecture
from gptpar.models.build import build_model, materialize
from gptpar.parallel.pipeline.one_process.gpt2 import build_parallel_model
from gptpar.presets import PRESETS

VOCAB = 300
# The family's tiny shapes made smaller still for the pool: width 32, 4 query heads of 8 over 2 key/value heads.
QWEN = ["model.preset=qwen2-tiny", "model.n_embd=32", "model.n_head=4"]
LLAMA = ["model.preset=llama-tiny", "model.n_embd=32", "model.n_head=4"]
# Instruction tuning on the bundled MetaMathQA-style pairs: the loss on response tokens only, token-weighted over
# replicas, micro-batches and pipeline chunks (prompts cut short so that examples differ in their response tokens).
SFT = ["data.task=sft", "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=24",
       "data.max_target_len=24"]
CASES_2 = [(f"qwen2-{sync}", [*QWEN, "parallel.dp=2", f"parallel.dp_sync={sync}"])
           for sync in ("naive", "bucketed", "ddp", "zero1", "zero2", "fsdp", "fsdp2")] + [
    ("qwen2-fsdp-meta", [*QWEN, "model.init_device=meta", "parallel.dp=2", "parallel.dp_sync=fsdp"]),
    ("qwen2-fsdp2-meta", [*QWEN, "model.init_device=meta", "parallel.dp=2", "parallel.dp_sync=fsdp2"]),
    ("qwen2-pp2-zbh1", [*QWEN, "parallel.pp=2", "parallel.pp_schedule=zb1p", "parallel.chunks=2"]),
    ("qwen2-pp2-interleaved", [*QWEN, "parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b",
                               "parallel.chunks=2"]),
    ("qwen2-tp2", [*QWEN, "parallel.tp=2"]),
    ("qwen2-tp2-sp-lp", [*QWEN, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.loss_parallel=true"]),
    ("qwen2-tp2-torch-sp-lp", [*QWEN, "parallel.tp=2", "parallel.tp_impl=torch", "parallel.sequence_parallel=true",
                               "parallel.loss_parallel=true"]),
    ("llama-fsdp2", [*LLAMA, "parallel.dp=2", "parallel.dp_sync=fsdp2"]),
    ("llama-tp2-sp", [*LLAMA, "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("llama-tp2-torch-lp", [*LLAMA, "parallel.tp=2", "parallel.tp_impl=torch", "parallel.loss_parallel=true"]),
    ("llama-pp2-gpipe", [*LLAMA, "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.chunks=2"]),
    ("qwen2-sft-fsdp2", [*QWEN, *SFT, "parallel.dp=2", "parallel.dp_sync=fsdp2"]),
    ("qwen2-sft-pp2", [*QWEN, *SFT, "parallel.pp=2", "parallel.chunks=2"]),
    ("qwen2-sft-tp2-sp", [*QWEN, *SFT, "parallel.tp=2", "parallel.sequence_parallel=true"]),
]
CASES_4 = [("qwen2-dp2-pp2", [*QWEN, "parallel.dp=2", "parallel.pp=2", "parallel.chunks=2"]),
           ("qwen2-dp2-tp2", [*QWEN, "parallel.dp=2", "parallel.tp=2", "parallel.dp_sync=fsdp"]),
           ("qwen2-pp2-tp2-sp", [*QWEN, "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.chunks=2"])]
# pp x tp x dp (8 ranks) is GPT-2's in tests/parallel/tensor_parallel/test_tensor_parallel.py; the family's own
# pieces are all exercised by the 2- and 4-rank layouts above.
ALL = dict(CASES_2 + CASES_4)


def _built(preset: str, init_device: str = "cpu", **fields: object) -> torch.nn.Module:
    cfg = load_config(None, [f"model.preset={preset}", *(f"model.{k}={v}" for k, v in fields.items())])
    return build_model(cfg.model, VOCAB, seed=3, seq_len=32, init_device=init_device)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_a_built_model_has_its_shapes_closed_form_parameter_count(preset: str) -> None:
    model = _built(preset, pad_vocab=1)
    assert type(model) is architecture(PRESETS[preset].arch).model_class
    assert sum(p.numel() for p in model.parameters()) == PRESETS[preset].parameters(VOCAB)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_each_registry_row_loads_its_own_description_and_sharding(row: ArchitectureRow) -> None:
    """The registry's "module:Object" strings name this architecture's code: a row pointing at another's description
    would build the wrong model under the right name."""
    described = architecture(row.name)
    assert described.name == row.name
    assert described.model_class.config_class.model_type == row.name
    assert bool(described.router) == row.mixture
    assert row.tp_shard == ARCHITECTURES[row.family].tp_shard  # a family is sharded by its first member's plan
    for ref in filter(None, (row.tp_shard, row.torch_tp_shard)):
        module, _, function = ref.partition(":")
        assert callable(getattr(import_module(module), function)), ref


def test_the_real_shapes_have_their_published_sizes() -> None:
    """Qwen2.5-0.5B 494M, Qwen2.5-3B 3.09B, Llama-3.2-1B 1.24B (all tied), with their tokenizers' vocabularies."""
    assert PRESETS["qwen2.5-0.5b"].parameters(151_936) == 494_032_768
    assert PRESETS["qwen2.5-3b"].parameters(151_936) == 3_085_938_688
    assert PRESETS["llama-3.2-1b"].parameters(128_256) == 1_235_814_400


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_the_pipeline_pieces_compute_the_models_own_logits(preset: str) -> None:
    model = _built(preset)
    arch = architecture(model)
    ids = torch.randint(0, VOCAB, (2, 16))
    hidden = arch.embed_piece(model)(ids)
    for index in range(len(arch.blocks(model))):
        hidden = arch.block_piece(model, index)(hidden)
    assert torch.equal(arch.head_piece(model)(hidden)[..., :VOCAB], model(ids).logits[..., :VOCAB])


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_a_meta_build_materialises_to_the_cpu_build_rotary_tables_included(preset: str) -> None:
    cpu, meta = _built(preset), _built(preset, init_device="meta")
    assert all(b.is_meta for b in meta.buffers())
    materialize(meta, 3, torch.device("cpu"))
    for (name, a), (_, b) in zip(cpu.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(cpu.named_buffers(), meta.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, VOCAB, (2, 16))
    assert torch.equal(cpu(ids).logits, meta(ids).logits)


def test_the_llama_family_starts_as_its_init_weights_says() -> None:
    model = _built("qwen2-tiny", pad_vocab=1)
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attn.q_proj.bias, torch.zeros_like(layer.self_attn.q_proj.bias))
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)  # no residual scaling
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _built("llama-tiny").lm_head.weight is not _built("llama-tiny").model.embed_tokens.weight


@pytest.mark.parametrize("mode", ["model_parallel", "pipeline_parallel"])
def test_the_one_process_modes_run_the_llama_family_as_the_model_runs(mode: str) -> None:
    model = _built("llama-tiny")
    ids = torch.randint(0, VOCAB, (4, 16))
    expected = model(ids).logits
    cfg = load_config(None, [f"parallel.pp_mode={mode}", "parallel.devices=cpu,cpu", "parallel.chunks=2"])
    torch.testing.assert_close(build_parallel_model(model, cfg.parallel)(ids), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.preset=qwen2-tiny", "model.n_kv_head=3"],
     "model.n_kv_head=3 must divide model.n_head=4 (each key/value head serves an equal group of query heads)"),
    (["model.n_kv_head=2"], "model.n_kv_head=2: GPT-2 has no grouped-query attention; leave it 0 or use "
                            "model.arch=llama or qwen2"),
    (["model.preset=llama-tiny", "model.init=pretrained"],
     "model.init=pretrained loads GPT-2's hub weights, not llama's; use model.init=random"),
    (["model.arch=mistral"], "model.arch: 'mistral' is not allowed"),
    (["model.preset=qwen2-tiny", "model.n_kv_head=1", "parallel.tp=2"],
     "parallel.tp=2 must divide model.n_kv_head=1; use a tp that divides it"),
])
def test_a_shape_that_cannot_be_built_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_another_architecture_keeps_the_presets_sizes() -> None:
    shape = load_config(None, ["model.preset=gpt2-tiny", "model.arch=llama", "model.n_kv_head=2"]).model.shape()
    assert (shape.arch, shape.n_layer, shape.n_embd, shape.n_head, shape.kv_heads) == ("llama", 4, 128, 4, 2)
    assert shape.mlp_width == 384  # 8/3 of the width, rounded up to a multiple of 64


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("architectures")
    gloo_pool.run(2, save_cases, runs, CASES_2)
    gloo_pool.run(4, save_cases, runs, CASES_4)
    return runs


_REFERENCES: dict[tuple[str, ...], dict] = {}


def _reference(results: Path, name: str) -> dict:
    """One process on the case's model and data: the same run for every layout of one model and task (the
    parallel.* keys are what the reference resets), so it is trained once per model and task."""
    key = tuple(o for o in ALL[name] if not o.startswith("parallel."))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(make_config(ALL[name], results, name))
    return _REFERENCES[key]


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.slow
def test_the_llama_family_trains_like_one_process(results: Path, name: str) -> None:
    table = architecture(PRESETS[ALL[name][0].split("=")[1]].arch).token_table
    assert_trains_like_one_process(_reference(results, name), saved_ranks(results, name), table, name)
