"""data.task=translation: pairs from jsonl/tsv (and the hub's form), masked labels, greedy decoding, corpus BLEU.

The fixture is a toy German-English corpus generated here: a word-for-word dictionary over sixteen nouns, with
one reordering (the last German word comes second in English), sentences of two to five words. A tiny GPT-2
learns it in a few hundred steps, far above the BLEU of copying the source. Data parallelism is checked on real
gloo groups through the trainer's own step: with per-rank target-token counts that differ, the ranks' mean loss,
the validation loss, the decoded sentences and the parameters equal one process's. The pipeline engine and tensor
parallelism (ours and torch's) run `Trainer.run` itself: their logged losses, epoch record (val_loss, BLEU) and
parameters equal one process's, on batches padded to the fixed width those layouts need. The corpus comes as train,
validation and test files (the same train and validation pairs as one file split by data.val_fraction), so every
layout also scores the test split (`test_bleu`); one file has no test split and logs none.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
import torch
from gloo_pool import GlooPools
from rank_training import STEPS, make_config, make_trainer, named_params, saved_ranks, train_steps

from gptpar.config import ConfigError, DataConfig, ModelConfig, fixed_width, load_config, updated
from gptpar.data.pair_files import PairSplits, read_pairs
from gptpar.data.pairs import IGNORE, load_pairs, target_tokens
from gptpar.errors import GptparError
from gptpar.launch.status import completion
from gptpar.models.build import build_model
from gptpar.parallel.process_group import RankInfo
from gptpar.run.folder import run_folder
from gptpar.run.logfile import format_record, read_rank_log
from gptpar.train.bleu import corpus_bleu, greedy_decode, require_sacrebleu
from gptpar.train.entry import run_rank
from gptpar.train.provenance import header_fields

DE = "hund katze haus baum auto buch tisch stuhl apfel brot wasser milch vogel fisch blume stadt".split()
EN = "dog cat house tree car book table chair apple bread water milk bird fish flower city".split()
LOCAL = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                 launcher="single", backend="gloo", device=torch.device("cpu"))


def toy_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """German sentences of 2-5 dictionary words; English maps each word and moves the last one second."""
    rng, pairs = random.Random(seed), []
    for _ in range(count):
        words = [rng.choice(DE) for _ in range(rng.randint(2, 5))]
        english = [EN[DE.index(w)] for w in words]
        pairs.append((" ".join(words), " ".join([english[0], english[-1], *english[1:-1]])))
    return pairs


def write_jsonl(path: Path, pairs: list[tuple[str, str]]) -> Path:
    """Alternating rows of both accepted forms: {"de", "en"} and the hub's {"translation": {...}}."""
    rows = [{"de": de, "en": en} if i % 2 else {"translation": {"de": de, "en": en}} for i, (de, en) in
            enumerate(pairs)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def one_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1600 pairs in one file: the last tenth (data.val_fraction) validates, and there is no test split."""
    return write_jsonl(tmp_path_factory.mktemp("toy") / "de-en.jsonl", toy_pairs(1600))


@pytest.fixture(scope="module")
def corpus(one_file: Path) -> str:
    """TRAIN,VALID,TEST: `one_file`'s train and validation pairs in two files, and 160 other sentences to test."""
    pairs = toy_pairs(1600)
    files = [write_jsonl(one_file.with_name(f"{split}.jsonl"), split_pairs) for split, split_pairs in
             (("train", pairs[:1440]), ("valid", pairs[1440:]), ("test", toy_pairs(160, seed=1)))]
    return ",".join(map(str, files))


def translation(source: Path | str) -> list[str]:
    return ["data.task=translation", f"data.source=jsonl:{source}", "data.tokenizer=bpe", "data.vocab_size=400",
            "data.max_source_len=12", "data.max_target_len=12", "train.bleu_samples=16"]


def test_jsonl_and_tsv_pairs_and_their_validation_and_test_splits(tmp_path: Path) -> None:
    pairs = toy_pairs(20)
    jsonl = write_jsonl(tmp_path / "a.jsonl", pairs)
    (tmp_path / "a.tsv").write_text("".join(f"{de}\t{en}\n\n" for de, en in pairs))  # blank lines are skipped
    for source in (f"jsonl:{jsonl}", f"tsv:{tmp_path / 'a.tsv'}"):
        assert read_pairs(DataConfig(task="translation", source=source, val_fraction=0.1)) == PairSplits(
            pairs[:18], pairs[18:], None)
    write_jsonl(tmp_path / "b.jsonl", pairs[:3])
    two_files = DataConfig(task="translation", source=f"jsonl:{jsonl},{tmp_path / 'b.jsonl'}", max_chars=60)
    split = read_pairs(two_files)
    assert split.val == pairs[:3] and 1 <= len(split.train) < 20 and split.test is None  # max_chars caps train only
    for name, some in (("b", pairs[:3]), ("c", pairs[5:7])):
        (tmp_path / f"{name}.tsv").write_text("".join(f"{de}\t{en}\n" for de, en in some))
    write_jsonl(tmp_path / "c.jsonl", pairs[5:7])
    for kind in ("jsonl", "tsv"):
        files = ",".join(str(tmp_path / f"{name}.{kind}") for name in ("a", "b", "c"))  # TRAIN,VALID,TEST
        assert read_pairs(DataConfig(task="translation", source=f"{kind}:{files}")) == PairSplits(pairs, pairs[:3],
                                                                                                  pairs[5:7])
    with pytest.raises(GptparError, match=r"names 4 files; use tsv:TRAIN, tsv:TRAIN,VALID or tsv:TRAIN,VALID,TEST$"):
        read_pairs(DataConfig(task="translation", source=f"tsv:{files},{jsonl}"))


@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad.jsonl", '{"de": "hund", "en": "dog"}\n{"de": "katze"}\n', r"bad.jsonl:2: expected an object with 'de' "
                                                                     r"and 'en' strings"),
    ("bad.jsonl", '{"de": "hund",\n', r"bad.jsonl:1: not valid JSON"),
    ("bad.tsv", "hund\tdog\nkatze dog\n", r"bad.tsv:2: expected de<TAB>en, got 1 field\(s\)"),
])
@pytest.mark.parametrize("as_test", [False, True])
def test_a_bad_line_fails_in_one_line_naming_it(tmp_path: Path, name: str, text: str, message: str,
                                                as_test: bool) -> None:
    (tmp_path / name).write_text(text)
    kind = name.split(".")[1]
    good = [tmp_path / f"{split}.{kind}" for split in ("train", "valid")]
    for path, (de, en) in zip(good, (("hund", "dog"), ("katze", "cat")), strict=True):
        path.write_text(json.dumps({"de": de, "en": en}) + "\n" if kind == "jsonl" else f"{de}\t{en}\n")
    files = f"{good[0]},{good[1]},{tmp_path / name}" if as_test else tmp_path / name  # the bad file as TEST or TRAIN
    with pytest.raises(GptparError, match=f"data.source={kind}: .*{message}") as err:
        read_pairs(DataConfig(task="translation", source=f"{kind}:{files}"))
    assert "\n" not in str(err.value)


def test_the_hub_dataset_offline_fails_in_one_line_without_hanging() -> None:
    start = time.perf_counter()
    with pytest.raises(GptparError, match=r"^data.source=hf:bbaaaa/iwslt14-de-en-preprocess: cannot load the "
                                          r"dataset; the Hugging Face hub is unreachable") as err:
        load_pairs(DataConfig(task="translation", source="hf:bbaaaa/iwslt14-de-en-preprocess"))
    assert "\n" not in str(err.value) and time.perf_counter() - start < 30


def test_a_hub_dataset_is_tested_on_its_test_split_where_it_has_one(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A local folder loads offline as a dataset whose splits are named by its files, like IWSLT14's on the hub."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # not the user's cache
    pairs = toy_pairs(6)
    splits = {"train": pairs[:3], "validation": pairs[3:5], "test": pairs[5:]}
    for name, files in (("three", ("train", "validation", "test")), ("two", ("train", "validation")),
                        ("one", ("train",))):
        (tmp_path / name).mkdir()
        for split in files:
            (tmp_path / name / f"{split}.jsonl").write_text(
                "".join(json.dumps({"translation": {"de": de, "en": en}}) + "\n" for de, en in splits[split]))
    assert read_pairs(DataConfig(task="translation", source=f"hf:{tmp_path / 'three'}")) == PairSplits(
        *splits.values())
    assert read_pairs(DataConfig(task="translation", source=f"hf:{tmp_path / 'two'}")).test is None
    with pytest.raises(GptparError, match=r": the dataset has no 'validation' split \(it has train\)$"):
        read_pairs(DataConfig(task="translation", source=f"hf:{tmp_path / 'one'}"))


def test_examples_mask_the_source_and_padding(corpus: str) -> None:
    data = load_pairs(load_config(None, translation(corpus)).data)
    assert data.test is not None and data.test.references[0] == toy_pairs(1, seed=1)[0][1]
    assert data.vocab_size == data.tokenizer.vocab_size + 2 and data.eos == data.vocab_size - 1
    (x0, y0), (x1, y1) = data.train[0], data.train[1]
    source, target = data.tokenizer.encode_each([toy_pairs(1)[0][0]])[0].tolist(), data.train.responses[0].tolist()
    assert data.train.prompts[0].tolist() == [*source, data.eos - 1]  # the source, then <sep>
    assert x0.tolist() == [*source, data.eos - 1, *target[:-1]] and target[-1] == data.eos
    assert y0.tolist() == [IGNORE] * len(source) + target  # <sep> and source tokens are not predicted
    assert data.text(target) == data.train.references[0] == toy_pairs(1)[0][1]
    x, y = data.collate([(x0, y0), (x1, y1)])
    assert x.shape == y.shape == (2, max(len(x0), len(x1)))
    short = 0 if len(x0) < len(x1) else 1
    assert (y[short, len((x0, x1)[short]):] == IGNORE).all()  # padding
    assert target_tokens(y) == sum(len(t) for t in data.train.responses[:2])  # targets and <eos>


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.task=translation"], r"data.task=translation reads pairs: data.source='stdlib' is not allowed"),
    (["data.source=jsonl:x.jsonl"], r"data.source='jsonl:x.jsonl' holds translation pairs; set data.task=translation"),
    ([*translation("x.jsonl"), "model.init=pretrained", "model.preset=gpt2"], r"use model.init=random"),
    ([*translation("x.jsonl"), "data.max_source_len=250"], r"data.max_source_len \+ data.max_target_len \+ 1 = "
                                                           r"263 positions exceed model.n_positions=256"),
    ([*translation("x.jsonl"), "parallel.tp=2", "parallel.sequence_parallel=true", "model.n_positions=25"],
     r"= 25 \(26 padded to a multiple of parallel.tp=2\) positions exceed model.n_positions=25"),
])
def test_config_refuses_what_translation_cannot_train(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_without_sacrebleu_bleu_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # what an environment without the package imports
    with pytest.raises(GptparError, match=r"^train.bleu_samples > 0 needs the translation extra: "
                                          r"pip install 'gptpar\[translation\]'"):
        require_sacrebleu()


def test_batched_greedy_decoding_equals_one_sentence_at_a_time() -> None:
    """Right-padded rows of different prompt lengths, each read at its own last position: as if decoded alone."""
    model = build_model(ModelConfig(n_layer=2, n_embd=32, n_head=2), 50, seed=3).eval()
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
    with torch.no_grad():
        def forward(ids: torch.Tensor) -> torch.Tensor:
            return model(ids).logits
        batched = greedy_decode(forward, prompts, eos=49, max_new=6, batch_size=3)
        alone = [greedy_decode(forward, [p], eos=49, max_new=6, batch_size=1)[0] for p in prompts]
    assert batched == alone and all(len(tokens) <= 6 for tokens in batched)


# ---- training: one process, the one-process pipeline, data parallelism -----------------------------------------

def _train_and_decode(cfg, info: RankInfo) -> dict:
    trainer = make_trainer(cfg, info)
    counts = [target_tokens(y) for _, y in next(trainer.batches(0, 0))]
    losses = train_steps(trainer, STEPS)
    splits = [split for split in (trainer.pairs.val, trainer.pairs.test) if split is not None]
    return {"losses": losses, "val": trainer.evaluate(), "bleu": trainer.scoring.bleu(),
            "hypotheses": trainer.scoring.translate(16, splits), "counts": counts, "params": named_params(trainer)}


def assert_nearly_all_close(value: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal to 1e-4 (1% of one AdamW step at lr 0.01) but for one element in a thousand, and none off by a step:
    AdamW's first update is about g / (|g| + eps), so an element whose gradient is near eps moves by a rounding
    difference's worth of a whole step. A gradient missing or weighted wrongly moves every element."""
    near = torch.isclose(value, expected, rtol=1e-4, atol=1e-4)
    assert near.float().mean() > 0.999 and (value - expected).abs().max() < 5e-3, name


DP_CASES = [
    ("bucketed-accum", ["parallel.dp=2", "train.grad_accum=2"]),
    ("ddp", ["parallel.dp=2", "parallel.dp_sync=ddp"]),
    ("zero2", ["parallel.dp=2", "parallel.dp_sync=zero2"]),
    ("fsdp", ["parallel.dp=2", "parallel.dp_sync=fsdp"]),
    ("fsdp2", ["parallel.dp=2", "parallel.dp_sync=fsdp2"]),
]


def _cases_worker(info: RankInfo, corpus: str, runs: Path, run: Callable[..., dict],
                  cases: list[tuple[str, list[str]]]) -> None:
    for name, overrides in cases:
        result = run(make_config([*translation(corpus), *overrides], runs, name), info)
        torch.save(result, runs / f"{name}.rank{info.rank}.pt")


def _two_ranks(pool: GlooPools, run: Callable[..., dict], cases: list[tuple[str, list[str]]], corpus: str,
               runs: Path) -> Path:
    """Every case on one pair of gloo ranks, each rank's result saved as <case>.rank<R>.pt under runs."""
    pool.run(2, _cases_worker, corpus, runs, run, cases)
    return runs


@pytest.fixture(scope="module")
def dp_runs(corpus: str, tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    return _two_ranks(gloo_pool, _train_and_decode, DP_CASES, corpus, tmp_path_factory.mktemp("dp"))


@pytest.fixture(scope="module")
def one_process(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    runs = tmp_path_factory.mktemp("single")
    return _train_and_decode(make_config(translation(corpus), runs, "single"), LOCAL)


@pytest.mark.parametrize("name", [name for name, _ in DP_CASES])
@pytest.mark.slow
def test_two_replicas_train_and_decode_like_one_process(corpus: str, dp_runs: Path, one_process: dict,
                                                        name: str) -> None:
    ranks = saved_ranks(dp_runs, name)
    cfg = make_config([*translation(corpus), *dict(DP_CASES)[name]], dp_runs, name)
    if cfg.train.grad_accum > 1:  # evaluation batches follow the micro-batch: train one process alike
        one_process = _train_and_decode(updated(cfg, {"parallel.dp": 1, "log.run_id": f"{name}-single"}), LOCAL)
    # The split matters: the ranks hold different numbers of target tokens, so a mean of rank means would differ.
    assert ranks[0]["counts"] != ranks[1]["counts"]
    mean = [sum(losses) / 2 for losses in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert mean == pytest.approx(one_process["losses"], rel=1e-5)
    test_references = [en for _, en in read_pairs(cfg.data).test[:16]]
    for rank in ranks:
        assert rank["val"] == pytest.approx(one_process["val"], rel=1e-5)
        assert rank["hypotheses"] == one_process["hypotheses"]  # both splits decoded in shares, gathered in order
        assert rank["bleu"] == ranks[0]["bleu"] == pytest.approx(one_process["bleu"])  # bleu and test_bleu
        assert rank["bleu"]["test_bleu"] == pytest.approx(corpus_bleu(rank["hypotheses"][1], test_references))
        for param, value in rank["params"].items():
            assert_nearly_all_close(value, one_process["params"][param], param)


@pytest.mark.parametrize(("mode", "bleu_samples", "test_file"), [("pipeline_parallel", 16, False),
                                                                  ("model_parallel", 0, True)])
def test_the_one_process_pipeline_trains_and_decodes_like_one_device(corpus: str, one_file: Path, one_process: dict,
                                                                     tmp_path: Path, mode: str, bleu_samples: int,
                                                                     test_file: bool) -> None:
    """The same train and validation pairs from one file (no test split) or from three."""
    cfg = make_config([*translation(corpus if test_file else one_file), f"parallel.pp_mode={mode}",
                       "parallel.devices=cpu,cpu", "parallel.chunks=2", f"train.bleu_samples={bleu_samples}"],
                      tmp_path, mode)
    result = _train_and_decode(cfg, LOCAL)
    assert result["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    assert result["val"] == pytest.approx(one_process["val"], rel=1e-5)
    assert result["hypotheses"] == (one_process["hypotheses"] if test_file else one_process["hypotheses"][:1])
    # No test_bleu key without a test split, nor with train.bleu_samples=0 (which turns BLEU off).
    assert result["bleu"] == ({"bleu": pytest.approx(one_process["bleu"]["bleu"])} if bleu_samples else {"bleu": None})


@pytest.mark.slow
def test_bleu_rises_far_above_copying_the_source(corpus: str, tmp_path: Path, capsys) -> None:
    """The whole run (`gptpar train`'s code): every epoch record carries BLEU, which climbs to a learnt model's, and
    the test split's."""
    cfg = load_config(None, [*translation(corpus), "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                             "train.batch_size=32", "train.epochs=5", "train.lr=5e-3", "train.min_lr=5e-4",
                             "train.warmup_steps=10", "train.eval_every=0", "train.bleu_samples=64", "train.threads=1",
                             "log.progress=lines", "log.every=1000", f"log.runs_dir={tmp_path}", "log.run_id=learn"])
    run_rank(cfg)
    log = read_rank_log(tmp_path / "learn" / "rank0.jsonl")
    scores = [log.epochs[e]["bleu"] for e in sorted(log.epochs)]
    tests = [log.epochs[e]["test_bleu"] for e in sorted(log.epochs)]
    val = read_pairs(cfg.data).val
    copied = corpus_bleu([de for de, _ in val[:64]], [en for _, en in val[:64]])
    assert len(scores) == len(tests) == 5 and all(isinstance(s, float) for s in scores + tests)
    assert copied < 5 and scores[-1] > 60 and scores[-1] > scores[0] + 40, scores
    assert tests[-1] > 60, tests  # unseen sentences of the same dictionary
    shown = f"bleu {scores[-1]:.2f}, test_bleu {tests[-1]:.2f}"
    assert shown in capsys.readouterr().out  # the epoch's progress line
    assert format_record(log.epochs[4]).endswith(shown)  # `gptpar logs`
    assert shown in completion(run_folder(tmp_path, "learn"))[1]  # the line `gptpar train` ends with


# ---- the pipeline engine and tensor parallelism: `Trainer.run` on fixed-width batches ------------------------------

SHORT = [f"train.max_steps={STEPS}", "train.eval_every=0", "log.progress=none"]  # one logged epoch record: STEPS steps
SP_LP = ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]
ENGINE_CASES = {  # name: (overrides, the fixed batch width: 12 + 12 + 1, rounded up to a multiple of tp with SP)
    "pp2-1f1b": (["parallel.pp=2", "parallel.chunks=2", "parallel.pp_schedule=1f1b"], 25),
    "tp2-sp-lp": (["parallel.tp=2", *SP_LP], 26),
    "tp2-torch-sp-lp": (["parallel.tp=2", "parallel.tp_impl=torch", *SP_LP], 26),
    "tp2-torch": (["parallel.tp=2", "parallel.tp_impl=torch"], None),  # the gathered logits, per-batch padding
}


def test_fixed_width_where_shapes_must_not_vary() -> None:
    widths = {name: fixed_width(load_config(None, [*translation("x.jsonl"), *overrides]))
              for name, (overrides, _) in ENGINE_CASES.items()}
    assert widths == {name: width for name, (_, width) in ENGINE_CASES.items()}
    assert fixed_width(load_config(None, translation("x.jsonl"))) is None  # one process: each batch to its longest
    assert fixed_width(load_config(None, ["parallel.pp=2", "model.n_layer=2"])) is None  # lm blocks are fixed already


def _run_and_decode(cfg, info: RankInfo) -> dict:
    """`Trainer.run` (what `gptpar train` runs) for STEPS steps: the logged global losses and epoch record, the
    first step's batch widths, the decoded sentences before (a random model seldom stops early, so every sentence
    is long) and after, and the whole parameters this rank holds."""
    trainer = make_trainer(cfg, info)
    widths = [x.size(1) for x, _ in next(trainer.batches(0, 0))]
    untrained = trainer.scoring.translate(16, [trainer.pairs.val])
    trainer.log.log("header", **header_fields(cfg, trainer.dims, restart=0))
    trainer.run()
    log = read_rank_log(trainer.log.path)
    return {"losses": [log.steps[step]["global_loss"] for step in sorted(log.steps)], "epoch": log.epochs[0],
            "widths": widths, "untrained": untrained, "hypotheses": trainer.scoring.translate(16, [trainer.pairs.val]),
            "params": named_params(trainer)}


@pytest.fixture(scope="module")
def engine_runs(corpus: str, tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> Path:
    cases = [(name, [*SHORT, *overrides]) for name, (overrides, _) in ENGINE_CASES.items()]
    return _two_ranks(gloo_pool, _run_and_decode, cases, corpus, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def short_single(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run_and_decode(make_config([*translation(corpus), *SHORT], tmp_path_factory.mktemp("short"), "single"),
                           LOCAL)


@pytest.mark.parametrize("name", list(ENGINE_CASES))
@pytest.mark.slow
def test_the_pipeline_engine_and_tensor_parallelism_train_and_decode_like_one_process(
        engine_runs: Path, short_single: dict, name: str) -> None:
    ranks, width = saved_ranks(engine_runs, name), ENGINE_CASES[name][1]
    assert max(short_single["widths"]) < 25  # one process pads each batch to its longest example only
    for rank in ranks:
        assert rank["widths"] == ([width] * len(rank["widths"]) if width else short_single["widths"])
        assert rank["losses"] == pytest.approx(short_single["losses"], rel=1e-5)
        assert rank["epoch"]["val_loss"] == pytest.approx(short_single["epoch"]["val_loss"], rel=1e-5)
        for key in ("bleu", "test_bleu"):  # the pipeline decodes both splits on one gathered model
            assert rank["epoch"][key] == ranks[0]["epoch"][key] == pytest.approx(short_single["epoch"][key])
        assert rank["hypotheses"] == short_single["hypotheses"]
        assert rank["untrained"] == short_single["untrained"]
    model: dict[str, torch.Tensor] = {}  # the whole model from every rank (a pipeline stage holds its own blocks)
    for rank in ranks:
        model |= rank["params"]
    assert set(model) - {"lm_head.weight"} == set(short_single["params"])
    for param, value in model.items():
        expected = short_single["params"]["transformer.wte.weight" if param == "lm_head.weight" else param]
        assert_nearly_all_close(value, expected, f"{name}: {param}")
