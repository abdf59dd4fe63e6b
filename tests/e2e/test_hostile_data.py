"""Hostile data (issue 26): files named twice, an example longer than the model's context, translation pairs that a
cap or a key leaves too few of. Each case is refused in one line naming the key or file at fault and the fix, before
anything trains on the wrong data; each test failed on the code before its fix.

In-process throughout: the real data functions on real files, the trainer's set-up, and `gptpar train`'s own main,
which must refuse before it makes a run folder or starts a rank (the conftest guard fails a test that starts one).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rank_training import make_trainer

from gptpar.cli import main as gptpar_main
from gptpar.config import ConfigError, load_config
from gptpar.data import load_tokens
from gptpar.data.pairs import load_pairs
from gptpar.errors import GptparError
from gptpar.parallel.process_group import RankInfo

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "train.batch_size=8", "train.max_steps=2", "train.threads=1", "log.progress=none"]
LOCAL = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                 launcher="single", backend="gloo", device=torch.device("cpu"))


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and len(message) < 400, message
    return message


# --- item 3: a file named twice trains twice and validates on what it trained on -------------------------------

def test_a_text_file_named_twice_or_copied_is_refused_naming_both(tmp_path: Path) -> None:
    text = "".join(f"line {i} of the corpus\n" for i in range(300))
    a, copy, other = tmp_path / "a.txt", tmp_path / "copy.txt", tmp_path / "other.txt"
    a.write_text(text)
    copy.write_text(text)
    other.write_text(text.replace("corpus", "cORPUS"))  # the same size, other content: not a duplicate
    (tmp_path / "link.txt").symlink_to(a)
    (tmp_path / "sub").mkdir()
    cases = {f"{a},{a}": f"names {a} twice; list each file once",
             f"{a},{tmp_path}/sub/../a.txt": f"names {a} twice (as {a} and {tmp_path}/sub/../a.txt); list each",
             f"{tmp_path / 'link.txt'},{a}": f"names {a} twice (as {tmp_path / 'link.txt'} and {a}); list each",
             f"{other},{a},{copy}": f"{a} and {copy} have the same content; list it once"}
    for files, message in cases.items():
        with pytest.raises(GptparError) as exc:
            load_tokens(load_config(None, [f"data.source=text:{files}", "data.tokenizer=bytes",
                                           f"data.dir={tmp_path / 'data'}"]).data)
        assert one_line(exc).startswith(f"data.source=text: {message}")
    splits = load_tokens(load_config(None, [f"data.source=text:{a},{other}", "data.tokenizer=bytes",
                                            f"data.dir={tmp_path / 'data'}"]).data)
    assert len(splits.train) + len(splits.val) == 2 * len(text) + 1  # two files, one newline between them


def test_a_translation_file_that_is_both_train_and_validation_is_refused(tmp_path: Path) -> None:
    train = tmp_path / "train.tsv"
    train.write_text("".join(f"hund {i}\tdog {i}\n" for i in range(20)))
    (tmp_path / "valid.tsv").write_text(train.read_text())
    for files in (f"{train},{train}", f"{train},{tmp_path / 'valid.tsv'}"):
        with pytest.raises(GptparError, match=r"^data.source=tsv: .* list (each file|it) once") as exc:
            load_pairs(load_config(None, ["data.task=translation", f"data.source=tsv:{files}",
                                                "data.tokenizer=bytes"]).data)
        one_line(exc)


# --- item 8: data.seq_len above model.n_positions, refused with the config under every layout --------------------

@pytest.fixture
def usr2_kept() -> Iterator[None]:
    """`gptpar train` makes USR2 a stop request in its process; this test's process gets its own handler back."""
    previous = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("layout", [[], ["parallel.pp=2"], ["parallel.dp=2"]], ids=["one-process", "pp2", "dp2"])
def test_seq_len_above_n_positions_is_refused_before_a_run_folder_or_a_rank(tmp_path: Path, capsys, usr2_kept,
                                                                             layout: list[str]) -> None:
    runs = tmp_path / "runs"
    assert gptpar_main(["train", *TINY, "model.n_positions=8", *layout, f"log.runs_dir={runs}"]) == 2
    assert capsys.readouterr().err == ("gptpar: error: data.seq_len=16 is above model.n_positions=8, the model's "
                                       "context length; lower data.seq_len or raise model.n_positions\n")
    assert not runs.exists()


def test_pretrained_weights_fix_the_context_whatever_model_n_positions_says() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["model.preset=gpt2", "model.init=pretrained", "model.n_positions=4096",
                           "data.seq_len=2048"])
    assert one_line(exc) == ("data.seq_len=2048 is above model.n_positions=1024, the model's context length; lower "
                             "data.seq_len (pretrained weights fix the context length)")


# --- item 9: translation pairs dropped by data.max_chars, and splits left empty -----------------------------------

def write_pairs(path: Path, pairs: list[tuple[str, str]]) -> str:
    path.write_text("".join(json.dumps({"de": de, "en": en}) + "\n" for de, en in pairs))
    return str(path)


@pytest.fixture
def one_huge_pair(tmp_path: Path) -> list[str]:
    """The issue's case, scaled down: a first pair longer than data.max_chars, then 50 small ones (and a
    validation file), as a translation config of a tiny model."""
    pairs = [("x" * 600, "y" * 600), *((f"hund {i}", f"dog {i}") for i in range(50))]
    valid = [(f"katze {i}", f"cat {i}") for i in range(8)]
    files = f"{write_pairs(tmp_path / 'train.jsonl', pairs)},{write_pairs(tmp_path / 'valid.jsonl', valid)}"
    return ["data.task=translation", f"data.source=jsonl:{files}", "data.tokenizer=bytes", "data.max_source_len=8",
            "data.max_target_len=8", "train.bleu_samples=0", f"log.runs_dir={tmp_path / 'runs'}"]


def test_pairs_dropped_by_max_chars_are_counted_where_too_few_are_left(one_huge_pair: list[str]) -> None:
    cfg = load_config(None, [*TINY, *one_huge_pair, "data.max_chars=1000", "log.run_id=capped"])
    with pytest.raises(GptparError) as exc:
        make_trainer(cfg, LOCAL)
    assert one_line(exc) == ("train.batch_size=8 exceeds the 1 training examples: data.max_chars=1000 kept 1 of 51 "
                             "training pairs (dropped 50); raise data.max_chars (0 reads all) or lower "
                             "train.batch_size")


def test_pairs_dropped_by_max_chars_are_said_in_the_banner(one_huge_pair: list[str]) -> None:
    cfg = load_config(None, [*TINY, *one_huge_pair, "data.max_chars=1300", "log.run_id=capped"])
    banner = make_trainer(cfg, LOCAL).banner()
    assert "; data.max_chars=1300 kept 11 of 51 training pairs (dropped 40); fp32; " in banner
    everything = load_config(None, [*TINY, *one_huge_pair, "data.max_chars=0", "log.run_id=all"])
    assert "data.max_chars" not in make_trainer(everything, LOCAL).banner()


def test_an_empty_split_names_the_file_or_the_key_that_emptied_it(tmp_path: Path) -> None:
    pairs = [(f"hund {i}", f"dog {i}") for i in range(50)]
    empty, full = write_pairs(tmp_path / "empty.jsonl", []), write_pairs(tmp_path / "full.jsonl", pairs)
    one = write_pairs(tmp_path / "one.jsonl", pairs[:1])
    cases = {
        (empty, "0.1"): f"data.source=jsonl: {empty} has no pairs; add some or name another file",
        (f"{full},{empty}", "0.1"): f"data.source=jsonl: {empty} has no pairs; add some or name another file",
        (full, "0"): (f"data.val_fraction=0 holds out none of the 50 pairs of {full} for validation; raise "
                      "data.val_fraction or name a validation file (jsonl:TRAIN,VALID)"),
        (one, "0.1"): (f"data.val_fraction=0.1 leaves none of the 1 pair(s) of {one} for training; add pairs or name "
                       "a validation file (jsonl:TRAIN,VALID)"),
    }
    for (files, val_fraction), message in cases.items():
        with pytest.raises(GptparError) as exc:
            load_pairs(load_config(None, ["data.task=translation", f"data.source=jsonl:{files}",
                                                f"data.val_fraction={val_fraction}", "data.tokenizer=bytes"]).data)
        assert one_line(exc) == message


def test_val_fraction_0_for_language_modelling_names_the_key() -> None:
    """Every lm source is split by position, so nothing would be left to validate on (the error came from the
    validation split's blocks and advised lowering data.seq_len)."""
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["data.val_fraction=0"])
    assert one_line(exc) == ("data.val_fraction=0 holds out no text for validation, which data.task=lm needs; use a "
                             "fraction above 0 (the default is 0.1)")


# --- issue 46, item 11: bad data is found by the submit side, before a run folder exists, as a bad key is --------

@pytest.mark.parametrize("command", [["train"], ["train", "parallel.dp=2"], ["submit", "dp"]],
                         ids=["one-process", "dp2", "submit"])
@pytest.mark.parametrize("data", ["sft-not-json", "corpus-not-utf8", "sft-no-responses"])
def test_bad_data_is_refused_before_a_run_folder_or_a_rank(tmp_path: Path, capsys, usr2_kept, command: list[str],
                                                            data: str) -> None:
    """Both were found on the rank, which left a `failed` run folder (after the queue, on SLURM)."""
    path = tmp_path / "data"
    if data == "sft-not-json":
        path.write_text('{"query": "q0", "response": "r0"}\n{"query": "q1", "response": \n')
        words, message = ["data.task=sft", f"data.source=jsonl:{path}", "data.max_source_len=8",
                          "data.max_target_len=7"], f"data.source=jsonl: {path}:2: not valid JSON (Expecting value)"
    elif data == "sft-no-responses":  # trained silently on the end token alone
        path.write_text("".join(json.dumps({"query": f"q{i}", "response": " " * (i % 2)}) + "\n" for i in range(20)))
        words, message = ["data.task=sft", f"data.source=jsonl:{path}", "data.max_source_len=8",
                          "data.max_target_len=7"], (f"data.source=jsonl: {path}: every training pair's response "
                                                     "('response') is empty, and the loss is on the responses; fill "
                                                     "them in, or name the field that holds them "
                                                     "(data.response_field for sft)\n")
    else:
        path.write_bytes("caf\u00e9\n".encode("latin-1") * 100)
        words, message = [f"data.source=text:{path}"], f"data.source=text: {path} is not UTF-8 text (byte 0xe9 at "
    runs = tmp_path / "runs"
    tiny = [w for w in TINY if not w.startswith("data.source=")]
    assert gptpar_main([*command, *tiny, "data.tokenizer=bytes", *words, f"log.runs_dir={runs}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gptpar: error: {message}") and err.count("\n") == 1, err
    assert not runs.exists()
