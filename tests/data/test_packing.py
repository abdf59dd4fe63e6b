"""data.packing: several pair examples per row, none attending to another.

In-process: rows are filled in order to their width, a packed row carries its examples' own labels and position
ids, and each architecture's logits on a packed row are those of its examples run alone (so its loss is the
unpacked examples' token-weighted loss); packing where the model does not run whole is one line. The layouts that
run the model whole (ddp, fsdp2 on the gloo pool) train packed sft like one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_pool import GlooPools
from rank_training import assert_trains_like_one_process, make_config, reference_run, save_cases, saved_ranks

from gptpar.config import ConfigError, load_config
from gptpar.data.packing import PackedPairs, pack_rows, stack_packed
from gptpar.data.pairs import IGNORE, load_pairs
from gptpar.data.training import load_training_data
from gptpar.models import packed_attention
from gptpar.models.build import build_model
from gptpar.models.loss import lm_loss
from gptpar.parallel.pipeline.one_process.gpt2 import build_parallel_model

SFT = ["data.task=sft", "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=40",
       "data.max_target_len=40", "data.packing=true"]


@pytest.fixture
def short_pairs(tmp_path: Path) -> list[str]:
    """sft on short problems of different lengths (bytes: 17 to 45 positions each), so rows hold several; 4
    validation rows, which every layout evaluates whole."""
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"query": f"{a} + {b * 7}?", "response": f"{a + b * 7}" + "!" * (a % 9)}) + "\n"
                            for a in range(30) for b in range(7)))
    return [*SFT, f"data.source=jsonl:{path}"]


def test_rows_are_filled_in_order_to_their_width() -> None:
    assert pack_rows([3, 4, 2, 5, 5, 1], width=8) == [[0, 1], [2, 3], [4, 5]]
    assert pack_rows([8, 1, 8], width=8) == [[0], [1], [2]]
    assert pack_rows([], width=8) == []


def test_a_packed_row_holds_its_examples_labels_and_restarted_positions(short_pairs: list[str]) -> None:
    data = load_pairs(load_config(None, short_pairs).data, 81)
    packed = PackedPairs(data.train, 81, data.eos)
    assert len(packed) < len(data.train) // 3  # these examples are short: rows hold three or more
    assert sorted(i for row in packed.rows for i in row) == list(range(len(data.train)))
    inputs, labels, positions = packed[0]
    assert inputs.shape == labels.shape == positions.shape == (81,)
    start = 0
    for index in packed.rows[0]:
        x, y = data.train[index]
        end = start + len(x)
        assert torch.equal(inputs[start:end], x) and torch.equal(labels[start:end], y)
        assert positions[start:end].tolist() == list(range(len(x)))
        start = end
    assert (labels[start:] == IGNORE).all() and (inputs[start:] == data.eos).all()  # the tail is padding
    batch = stack_packed([packed[0], packed[1]])
    assert [t.shape for t in batch] == [(2, 81)] * 3


def test_training_data_packs_train_and_validation() -> None:
    data = load_training_data(load_config(None, SFT))
    assert isinstance(data.train, PackedPairs) and isinstance(data.val, PackedPairs)
    assert data.collate is stack_packed and data.train.width == 81


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_a_packed_row_computes_each_examples_own_logits_and_loss(short_pairs: list[str], preset: str) -> None:
    cfg = load_config(None, [*short_pairs, f"model.preset={preset}", "model.pad_vocab=1"])
    data = load_pairs(cfg.data, 81)
    packed = PackedPairs(data.train, 81, data.eos)
    model = build_model(cfg.model, data.vocab_size, seed=2, seq_len=81).eval()
    net = build_parallel_model(model, cfg.parallel, torch.device("cpu"))
    inputs, labels, positions = stack_packed([packed[0], packed[1]])
    assert min(len(packed.rows[0]), len(packed.rows[1])) >= 3
    logits = net(inputs, positions)
    pieces_logits, pieces_labels = [], []
    for row in (0, 1):
        start = 0
        for index in packed.rows[row]:
            x, y = data.train[index]
            alone = model(x[None]).logits[0]
            torch.testing.assert_close(logits[row, start:start + len(x)], alone, rtol=1e-5, atol=1e-5)
            pieces_logits.append(alone)
            pieces_labels.append(y)
            start += len(x)
    unpacked = lm_loss(torch.cat(pieces_logits)[None], torch.cat(pieces_labels)[None])
    torch.testing.assert_close(lm_loss(logits, labels), unpacked, rtol=1e-5, atol=1e-6)


def test_the_mask_keeps_each_example_to_itself() -> None:
    mask = packed_attention(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.packing=true"], "data.packing=true packs pair examples; data.task=lm trains on blocks that are full "
                            "already; use data.task=sft or translation, or data.packing=false"),
    ([*SFT, "parallel.pp=2"], "data.packing=true needs the model run whole, which parallel.pp=2 splits; use "
                              "data.packing=false there"),
    ([*SFT, "parallel.tp=2", "model.preset=qwen2-tiny"], "which parallel.tp=2 splits"),
    ([*SFT, "parallel.pp_mode=model_parallel", "parallel.devices=cpu,cpu"], "which parallel.pp_mode=model_parallel "
                                                                            "splits"),
])
def test_packing_where_the_model_does_not_run_whole_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_packed_sft_trains_like_one_process_under_data_parallelism(short_pairs: list[str], tmp_path: Path,
                                                                    gloo_pool: GlooPools) -> None:
    """Replicas hold different numbers of response tokens per packed row: the step is still one process's."""
    model = ["model.preset=qwen2-tiny", "model.n_embd=32", "model.n_head=4"]
    cases = [(sync, [*model, *short_pairs, "parallel.dp=2", f"parallel.dp_sync={sync}", "train.batch_size=4"])
             for sync in ("ddp", "fsdp2")]
    gloo_pool.run(2, save_cases, tmp_path, cases)
    ref = reference_run(make_config(cases[0][1], tmp_path, "reference"))
    for name, _ in cases:
        assert_trains_like_one_process(ref, saved_ranks(tmp_path, name), "model.embed_tokens.weight", name)
