"""Mixtures of experts (model.arch=mixtral, qwen2_moe): their shapes, the router's load-balancing loss, and data
parallelism training them exactly like one process.

In-process: the presets' parameter counts are their closed forms and the published totals (built on the meta device for
the real shapes), MFU counts the active parameters by a hand count, the load-balancing loss is transformers' own on one
process and leaves padding out, and over two in-process replicas is one process's on their rows (value and gradient),
the logged loss includes it and the step record carries it with the expert load, a folder's config gives the mixture's
shape, and bad settings are one line. On the shared gloo pool: every
data-parallel strategy (and deferred initialisation) trains qwen2-moe-tiny, and fsdp2 mixtral-tiny and sft, like one
process, with the auxiliary loss on (its routing statistics gathered over the replicas).
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import GlooPools
from rank_training import (
    assert_trains_like_one_process,
    make_config,
    make_trainer,
    reference_run,
    save_cases,
    saved_ranks,
    train_steps,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from analysis.mfu import FlopsShape, flops_per_token
from gptpar.config import ConfigError, load_config
from gptpar.data.pairs import IGNORE
from gptpar.launch.prepare import prepare_run
from gptpar.models import architecture
from gptpar.models.build import build_model
from gptpar.parallel.grid import launched_config
from gptpar.parallel.process_group import RankInfo
from gptpar.presets import PRESETS
from gptpar.pretrained import folder_shape
from gptpar.train.moe import RouterLoad, real_positions
from gptpar.train.step_records import read_now

# Smaller still for the pool: width 32, 4 heads over 2 key/value heads; a larger auxiliary weight, so a wrong
# gradient of it would move the parameters visibly.
QWEN_MOE = ["model.preset=qwen2-moe-tiny", "model.n_embd=32", "model.n_head=4", "model.moe_aux_loss_coef=0.1"]
MIXTRAL = ["model.preset=mixtral-tiny", "model.n_embd=32", "model.n_head=4", "model.moe_aux_loss_coef=0.1"]
SFT = ["data.task=sft", "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=24",
       "data.max_target_len=24"]
CASES = [(f"qwen2-moe-{sync}", [*QWEN_MOE, "parallel.dp=2", f"parallel.dp_sync={sync}"])
         for sync in ("bucketed", "zero1", "zero2", "fsdp", "fsdp2")] + [  # naive, ddp: test_expert_parallel.py
    ("qwen2-moe-fsdp2-meta", [*QWEN_MOE, "model.init_device=meta", "parallel.dp=2", "parallel.dp_sync=fsdp2"]),
    ("mixtral-fsdp2", [*MIXTRAL, "parallel.dp=2", "parallel.dp_sync=fsdp2"]),
    ("qwen2-moe-sft-ddp", [*QWEN_MOE, *SFT, "parallel.dp=2", "parallel.dp_sync=ddp"]),
]
VOCAB = 300


@pytest.mark.parametrize("preset", ["qwen2-moe-tiny", "mixtral-tiny"])
def test_a_built_mixture_has_its_shapes_closed_form_parameter_count(preset: str) -> None:
    model = build_model(load_config(None, [f"model.preset={preset}", "model.pad_vocab=1"]).model, VOCAB, seed=1)
    assert type(model) is architecture(PRESETS[preset].arch).model_class
    assert sum(p.numel() for p in model.parameters()) == PRESETS[preset].parameters(VOCAB)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (PRESETS[preset].n_experts, 2 * PRESETS[preset].mlp_width, 128)


@pytest.mark.parametrize(("preset", "vocab", "published"), [("qwen1.5-moe-a2.7b", 151_936, 14_315_784_192),
                                                             ("mixtral-8x7b", 32_000, 46_702_792_704)])
def test_the_real_mixtures_have_their_published_sizes(preset: str, vocab: int, published: int) -> None:
    shape = PRESETS[preset]
    arch = architecture(shape.arch)
    with torch.device("meta"):
        model = arch.model_class(arch.config_of(shape, vocab, 0.0))
    assert sum(p.numel() for p in model.parameters()) == shape.parameters(vocab) == published


def test_mfu_counts_the_active_parameters_by_hand() -> None:
    """Qwen1.5-MoE-A2.7B at T=4096 (24 layers, d=2048, 16 heads of 128 and 16 KV heads, 60 experts of 1408, top 4, a
    shared expert of 5632): a block's attention is 4·2048² = 16,777,216 and q/k/v biases 3·2048 = 6,144; the router
    60·2048 = 122,880; four experts 4·3·2048·1408 = 34,603,008; the shared expert 3·2048·5632 = 34,603,008 and its
    gate 2048; two norms 4,096: 86,118,400 active of 570,560,512. N = 24·86,118,400 + 2048 = 2,066,843,648 (with the
    two tables, the 2.7B activated the name says); 6N = 12,401,061,888; the head 6·151,936·2048 = 1,866,989,568;
    attention 12·24·16·128·4096 = 2,415,919,104."""
    shape = PRESETS["qwen1.5-moe-a2.7b"]
    assert (shape.active_block_parameters(), shape.block_parameters()) == (86_118_400, 570_560_512)
    assert flops_per_token(FlopsShape(shape, 4096, 151_936)) == 12_401_061_888 + 1_866_989_568 + 2_415_919_104


def test_real_positions_stop_at_each_rows_last_counted_label() -> None:
    labels = torch.tensor([[IGNORE, 5, 6, IGNORE, IGNORE], [IGNORE, IGNORE, 7, 8, 9], [1, 2, 3, 4, 5]])
    assert real_positions(labels).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("preset", ["qwen2-moe-tiny", "mixtral-tiny"])
def test_the_load_balancing_loss_is_transformers_own_and_leaves_padding_out(preset: str) -> None:
    cfg = load_config(None, [f"model.preset={preset}"])
    shape, model = cfg.model.shape(), build_model(cfg.model, VOCAB, seed=4)
    load = RouterLoad(architecture(model).routers(model), shape.n_experts, shape.top_k, None, 1)
    ids = torch.randint(0, VOCAB, (3, 20))
    with load.recording():
        out = model(ids, output_router_logits=True)
    expected = load_balancing_loss_func(out.router_logits, shape.n_experts, shape.top_k)
    torch.testing.assert_close(load.aux_loss(torch.zeros_like(ids)), expected, rtol=1e-6, atol=0)
    padded = torch.cat([ids[:, :12], torch.zeros(3, 8, dtype=torch.long)], dim=1)  # 8 positions of padding
    labels = torch.cat([ids[:, :12], torch.full((3, 8), IGNORE)], dim=1)
    with load.recording():
        model(padded)
    with torch.no_grad():
        alone = load_balancing_loss_func(model(ids[:, :12], output_router_logits=True).router_logits,
                                         shape.n_experts, shape.top_k)
    torch.testing.assert_close(load.aux_loss(labels), alone, rtol=1e-6, atol=0)  # causal: the prefix routes alike
    fields = read_now(load.step_fields())
    assert fields["aux_loss"] == pytest.approx((expected.item() + alone.item()) / 2)
    tokens = fields["moe"]["tokens_per_expert"]
    assert tokens["mean"] == pytest.approx((60 + 36) * shape.top_k / shape.n_experts)  # both forwards' picks
    assert tokens["min"] <= tokens["mean"] <= tokens["max"] and fields["moe"]["dropped"] == 0


def _aux_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup | None,
                   replicas: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One replica's load-balancing loss on its rows and the gradient it backpropagates into every parameter."""
    shape = load_config(None, ["model.preset=qwen2-moe-tiny"]).model.shape()
    load = RouterLoad(architecture(model).routers(model), shape.n_experts, shape.top_k, group, replicas)
    with load.recording():
        model(ids)
    aux = load.aux_loss(labels)
    aux.backward()
    return aux.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_load_balancing_loss_over_two_replicas_is_one_process_on_their_rows() -> None:
    """Two data-parallel replicas in this process (two threads, a gloo group on an in-memory store), each with half of
    the rows (padding in both halves): each replica's aux is the one process's on all the rows, and the gradients
    they backpropagate, averaged as data parallelism averages them, are the one process's (a replica's is R times its
    share). Measured: the value bitwise equal (rel 1e-6 allowed: an ulp or so where sums run in another order), the
    gradients within 1.9e-9 = 3.7e-7 of the largest (1.6e-2): fp32 rounding of half-batch sums."""
    cfg = load_config(None, ["model.preset=qwen2-moe-tiny", "model.n_embd=32", "model.n_head=4"])
    model = build_model(cfg.model, VOCAB, seed=4)
    ids = torch.randint(0, VOCAB, (4, 20), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 14:] = labels[2, 9:] = IGNORE  # right padding in each replica's half
    one_aux, one_grads = _aux_and_grads(copy.deepcopy(model), ids, labels, None, 1)
    store, results = dist.HashStore(), {}

    def replica(rank: int) -> None:
        group = dist.ProcessGroupGloo(store, rank, 2)
        rows = slice(2 * rank, 2 * rank + 2)
        results[rank] = _aux_and_grads(copy.deepcopy(model), ids[rows], labels[rows], group, 2)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[r][0] for r in range(2)] == pytest.approx([one_aux, one_aux], rel=1e-6)
    assert results[0][1].keys() == results[1][1].keys() == one_grads.keys()
    atol = 1e-6 * max(float(grad.abs().max()) for grad in one_grads.values())  # 3x the measured 3.7e-7
    for name, grad in one_grads.items():
        torch.testing.assert_close((results[0][1][name] + results[1][1][name]) / 2, grad, rtol=0, atol=atol, msg=name)


def test_the_logged_loss_includes_the_weighted_auxiliary_loss(tmp_path: Path) -> None:
    info = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                    launcher="single", backend="gloo", device=torch.device("cpu"))
    losses = {}
    for coef in (0.0, 0.5):
        trainer = make_trainer(make_config([*QWEN_MOE, f"model.moe_aux_loss_coef={coef}"], tmp_path, f"c{coef}"), info)
        losses[coef] = train_steps(trainer, 1)[0]
        fields = read_now(trainer.router_load.step_fields())
    # The first step's batch and weights are the same: only the auxiliary term differs (aux_loss of the last trainer).
    assert losses[0.5] - losses[0.0] == pytest.approx(0.5 * fields["aux_loss"], rel=1e-5)
    assert fields["aux_loss"] == pytest.approx(2, rel=0.05)  # top-2 at initialisation: the routing is near even


def test_a_folder_of_a_mixture_has_its_shape(tmp_path: Path) -> None:
    shape = PRESETS["qwen2-moe-tiny"]
    arch = architecture(shape.arch)
    (tmp_path / "config.json").write_text(json.dumps(arch.config_of(shape, VOCAB, 0.0).to_dict()))
    assert folder_shape(tmp_path) == shape


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.preset=qwen2-moe-tiny", "model.moe_top_k=9"],
     "model.moe_top_k=9 must be between 1 and model.n_experts=8"),
    (["model.n_experts=4"], "model.n_experts=4: gpt2 has no experts; use model.arch=mixtral or qwen2_moe"),
    (["model.preset=mixtral-tiny", "parallel.dp=4", "parallel.ep=3"], "parallel.ep=3 must divide parallel.dp=4"),
    (["model.preset=mixtral-tiny", "parallel.dp=3", "parallel.ep=3", "train.batch_size=15"],
     "parallel.ep=3 must divide model.n_experts=4"),
    (["parallel.dp=2", "parallel.ep=2"], "parallel.ep=2 splits a mixture's experts; gpt2 has none"),
    (["model.preset=mixtral-tiny", "parallel.dp=2", "parallel.ep=2", "train.dump_grads=g.pt"],
     "train.dump_grads with parallel.ep=2: each rank holds only its own experts' gradients"),
    (["model.preset=mixtral-tiny", "parallel.dp=2", "parallel.ep=2", "parallel.dp_sync=fsdp"],
     "parallel.ep=2 with parallel.dp_sync=fsdp is not built yet; use naive, bucketed, ddp, zero1, zero2 or fsdp2"),
    (["model.preset=mixtral-tiny", "model.moe_capacity_factor=-1"], "model.moe_capacity_factor: -1.0 is below the "
                                                                    "minimum 0.0"),
    (["model.preset=mixtral-tiny", "parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true",
      "parallel.dp_sync=zero2"], "parallel.sequence_parallel=true with a mixture of experts (mixtral) and "
                                 "parallel.dp_sync=zero2 is not built yet"),
    (["model.preset=mixtral-tiny", "parallel.tp=2", "parallel.tp_impl=torch"],
     "parallel.tp_impl=torch with a mixture of experts (mixtral) is not built yet"),
    (["model.preset=mixtral-tiny", "parallel.pp_mode=pipeline_parallel"],
     "parallel.pp_mode=pipeline_parallel with a mixture of experts (mixtral) is not built yet"),
    (["model.preset=mixtral-tiny", "train.compile=blocks"], "train.compile=blocks with a mixture of experts is not "
                                                            "built yet"),
])
def test_a_mixture_that_cannot_be_trained_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_expert_parallelism_takes_its_data_parallel_size_from_the_jobs_shape(tmp_path: Path) -> None:
    """parallel.ep without parallel.dp: a dp job of 4 GPUs (or a launcher of 4 ranks) fills dp=4 in and ep=2 divides
    it; where nothing fills it, the one replica cannot hold two expert ranks, in one line before anything is
    written."""
    cfg = load_config(None, ["model.preset=qwen2-moe-tiny", "parallel.ep=2", "launch.gpus=4"])
    point = prepare_run(cfg, "dp", tmp_path, "ep", write=False)
    assert (point.cfg.parallel.dp, point.cfg.parallel.ep) == (4, 2)
    assert launched_config(cfg, 4).parallel.dp == 4
    for refused in (lambda: prepare_run(cfg, None, tmp_path, "ep"), lambda: launched_config(cfg, 1)):
        with pytest.raises(ConfigError, match=r"^parallel.ep=2 must divide parallel.dp=1 \(expert parallelism"):
            refused()
    assert not (tmp_path / "ep").exists()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    runs = tmp_path_factory.mktemp("moe")
    gloo_pool.run(2, save_cases, runs, CASES)
    return runs


_REFERENCES: dict[tuple[str, ...], dict] = {}


@pytest.mark.parametrize("name", [name for name, _ in CASES])
@pytest.mark.slow
def test_data_parallelism_trains_a_mixture_like_one_process(results: Path, name: str) -> None:
    overrides = dict(CASES)[name]
    key = tuple(o for o in overrides if not o.startswith("parallel."))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(make_config(overrides, results, name))
    assert_trains_like_one_process(_REFERENCES[key], saved_ranks(results, name), "model.embed_tokens.weight", name)
