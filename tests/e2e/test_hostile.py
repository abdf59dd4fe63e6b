"""Hostile and careless users: the cases of the reliability issue (issue 17), one test or more each.

Every case here was first seen going wrong (a traceback, a silently wrong run, stale results) and each
test failed on the code of that time. They are grouped by section so the list can grow: add a case
under its section, or a new section, rather than scattering them over the other test files.

The contract for user mistakes: a `GptparError` (`ConfigError` subclasses it) whose message is one
line naming the key or file at fault and what is allowed instead.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from gptpar.config import ConfigError, ModelConfig, load_config
from gptpar.data import corpus as corpus_module
from gptpar.data import load_tokens
from gptpar.data.sources import cache_dir, text_paths
from gptpar.errors import GptparError
from gptpar.models.build import build_model, model_config


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message.strip() == message, message
    assert len(message) < 400, message
    return message


def data_cfg(tmp_path: Path, source: str, *more: str):
    """The data section of a config as the CLI would build it, with a private data/cache folder."""
    return load_config(None, [f"data.source={source}", "data.tokenizer=bytes",
                              f"data.dir={tmp_path / 'data'}", *more]).data


# --- Config values: NaN, infinities, huge integers, upper bounds ------------------------------------

NON_FINITE = [
    ("train.lr=nan", "train.lr: nan is not a number; expected a finite number >= 0.0"),
    ("train.grad_clip=nan", "train.grad_clip: nan is not a number; expected a finite number >= 0.0"),
    ("train.grad_clip=NaN", "train.grad_clip: nan is not a number"),
    ("train.min_lr=nan", "train.min_lr: nan is not a number"),
    ("model.dropout=nan", "model.dropout: nan is not a number; expected a finite number >= 0.0 and <= 1.0"),
    ("parallel.timeout_s=nan", "parallel.timeout_s: nan is not a number"),
    ("train.lr=inf", "train.lr: inf is not finite; expected a finite number >= 0.0"),
    ("train.lr=-inf", "train.lr: -inf is not finite"),
    ("train.lr=1e999", "train.lr: inf is not finite"),
    ("train.grad_clip=inf", "train.grad_clip: inf is not finite"),
    ("train.weight_decay=inf", "train.weight_decay: inf is not finite"),
    ("parallel.timeout_s=inf", "parallel.timeout_s: inf is not finite"),
    ("data.hub_timeout_s=inf", "data.hub_timeout_s: inf is not finite"),
]
BEYOND_64_BITS = [
    ("train.max_steps=99999999999999999999999",
     "train.max_steps: 99999999999999999999999 does not fit in a 64-bit integer; expected an integer >= 0"),
    ("train.seed=-99999999999999999999999", "train.seed: -99999999999999999999999 does not fit in a 64-bit"),
    ("train.warmup_steps=9223372036854775808", "train.warmup_steps: 9223372036854775808 does not fit"),
    ("train.max_steps=" + "9" * 5000, "train.max_steps: expected an integer, got '99999"),
]


@pytest.mark.parametrize("override, message", NON_FINITE + BEYOND_64_BITS)
def test_nan_infinity_and_integers_beyond_64_bits_fail_in_one_line(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as exc:
        load_config(None, [override])
    one_line(exc)


def test_nan_and_infinity_from_yaml_fail_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=re.escape("train.lr: nan is not a number")):
        load_config(path)
    path.write_text("train:\n  grad_clip: .inf\n")
    with pytest.raises(ConfigError, match=re.escape("train.grad_clip: inf is not finite")):
        load_config(path)


def test_a_large_finite_learning_rate_is_a_legitimate_experiment():
    cfg = load_config(None, ["train.lr=1e6", "train.min_lr=0"])
    assert cfg.train.lr == 1e6


def test_a_huge_yaml_integer_for_a_number_field_fails_in_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1" + "0" * 400 + "\n")  # YAML reads an int too big for a float
    with pytest.raises(ConfigError, match=re.escape("train.lr: 1000000000")) as exc:
        load_config(path)
    assert "is not finite" in one_line(exc)


COUNTS = ["parallel.dp", "parallel.chunks", "train.batch_size", "train.grad_accum", "train.epochs",
          "train.eval_batches", "train.threads", "data.seq_len", "data.vocab_size", "data.synthetic_tokens",
          "model.n_layer", "model.n_embd", "model.n_head", "model.n_positions", "launch.gpus",
          "launch.nodes", "launch.cpus_per_task", "launch.max_concurrent"]


@pytest.mark.parametrize("key", COUNTS)
def test_counts_have_an_upper_bound(key):
    with pytest.raises(ConfigError, match=re.escape(f"{key}: 1000000000000 is above the maximum ")) as exc:
        load_config(None, [f"{key}=1000000000000"])
    one_line(exc)


def test_the_bounds_are_generous():
    cfg = load_config(None, ["parallel.dp=65536", "train.batch_size=65536", "data.seq_len=1048576",
                             "model.n_positions=1048576", "launch.nodes=4096", "launch.gpus=16"])
    assert cfg.parallel.dp == 65536 and cfg.data.seq_len == 1_048_576
    for override in ("parallel.dp=65537", "data.seq_len=1048577"):
        with pytest.raises(ConfigError, match="is above the maximum"):
            load_config(None, [override])


@pytest.mark.parametrize("override", ["parallel.timeout_s=1e300", "parallel.bucket_mb=1e300",
                                      "data.hub_timeout_s=1e300"])
def test_durations_and_sizes_that_would_overflow_later_are_refused(override):
    with pytest.raises(ConfigError, match="is above the maximum") as exc:
        load_config(None, [override])
    one_line(exc)


@pytest.mark.parametrize("overrides, message", [
    (["model.preset=llama-tiny", "model.arch=mixtral"],  # was 110 lines: "torch.histc bins must be > 0"
     "model.arch=mixtral is a mixture of experts, and model.preset=llama-tiny has none; set model.n_experts and "
     "model.moe_top_k, or use a preset of one (e.g. mixtral-tiny)"),
    (["model.preset=mixtral-tiny", "model.moe_capacity_factor=1e300"],  # was an OverflowError in a rank
     "model.moe_capacity_factor=1e+300 is above model.n_experts=4, where each expert has room for every pick of "
     "every token already; use at most 4, or 0 to route every token"),
])
def test_a_mixture_without_experts_or_with_a_boundless_capacity_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert one_line(exc) == message
    load_config(None, ["model.preset=mixtral-tiny", "model.moe_capacity_factor=4"])  # the bound itself is allowed


# --- Config files ------------------------------------------------------------------------------------

def test_a_yaml_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("log:\n  name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not UTF-8 text")) as exc:
        load_config(path)
    one_line(exc)
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not UTF-8 text")) as exc:
        load_config(path)
    one_line(exc)


# --- Model shape against the data --------------------------------------------------------------------

def test_seq_len_above_n_positions_is_one_line():
    with pytest.raises(GptparError, match=re.escape("data.seq_len=128 is above model.n_positions=64")) as exc:
        model_config(ModelConfig(n_positions=64), 256, seq_len=128)
    one_line(exc)
    # The preset's context length counts when model.n_positions keeps it (gpt2-tiny: 256).
    with pytest.raises(GptparError, match=re.escape("data.seq_len=512 is above model.n_positions=256")):
        model_config(ModelConfig(), 256, seq_len=512)
    assert model_config(ModelConfig(), 256, seq_len=256).n_positions == 256


def test_seq_len_check_covers_every_way_a_model_is_built():
    # build_model is what single, model_parallel and pipeline_parallel modes all start from.
    with pytest.raises(GptparError, match=re.escape("data.seq_len=300 is above model.n_positions=256")):
        build_model(ModelConfig(), 256, seed=0, seq_len=300)
    with pytest.raises(GptparError, match=re.escape("data.seq_len=2048 is above model.n_positions=1024")):
        build_model(ModelConfig(preset="gpt2", init="pretrained"), 50257, seed=0, seq_len=2048)


# --- Text sources --------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [
    "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 40,  # latin-1
    bytes(range(256)) * 8,  # binary
    b"\x00" * 2000,  # valid UTF-8, but NUL bytes: not text
], ids=["latin1", "binary", "nul"])
def test_a_text_file_that_is_not_utf8_is_one_line(tmp_path, content):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(GptparError, match=re.escape(f"data.source=text: {path} is not UTF-8 text")) as exc:
        load_tokens(data_cfg(tmp_path, f"text:{path}"))
    one_line(exc)


@pytest.mark.parametrize("source", ["text:", "text:,", "text: "])
def test_text_source_without_a_path_is_one_line(tmp_path, source):
    with pytest.raises(GptparError, match=re.escape("data.source=text: names no file")) as exc:
        load_tokens(data_cfg(tmp_path, source))
    one_line(exc)


def test_a_missing_text_file_is_still_one_line(tmp_path):
    with pytest.raises(GptparError, match="data.source=text: '.*missing.txt' does not exist") as exc:
        load_tokens(data_cfg(tmp_path, f"text:{tmp_path / 'missing.txt'}"))
    one_line(exc)


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_pipe_or_a_device_as_a_text_file_is_one_line(tmp_path, special):
    """Both hung for minutes, hashing without end, then ignored SIGTERM."""
    path = tmp_path / "pipe" if special == "fifo" else Path(special)
    if special == "fifo":
        os.mkfifo(path)
    kind = "a named pipe" if special == "fifo" else "a character device"
    for source in (f"text:{path}", f"jsonl:{path}"):
        with pytest.raises(GptparError) as exc:
            text_paths(source)
        assert one_line(exc) == (f"data.source={source.partition(':')[0]}: {path} is {kind}, not a regular file; "
                                 "save the text in a file and name that")


def test_a_text_file_is_read_and_hashed_only_as_far_as_data_max_chars_can_use(tmp_path, monkeypatch):
    """UTF-8 spends at most 4 bytes on a character: past 4 * max_chars bytes nothing is read, nor hashed."""
    path = tmp_path / "corpus.txt"
    path.write_bytes("é".encode() * 200 + b"\xff" * 1000)  # 400 bytes of text, then bytes that are not UTF-8
    cfg = data_cfg(tmp_path, f"text:{path}", "data.max_chars=100", "data.val_fraction=0.5")
    first = load_tokens(cfg)
    assert as_text(np.concatenate([first.train, first.val])) == "é" * 100
    stat = path.stat()
    path.write_bytes("é".encode() * 200 + b"\xfe" * 1000)  # an edit past what is used, keeping size and mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.setattr(corpus_module, "load_text", lambda _cfg: pytest.fail("tokenized again for unused bytes"))
    assert np.array_equal(load_tokens(cfg).train, first.train)


# --- The token cache ---------------------------------------------------------------------------------

def as_text(tokens: np.ndarray) -> str:
    return bytes(np.asarray(tokens).astype(np.uint8)).decode()


def test_editing_a_text_file_retokenizes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first version\n" * 100)
    cfg = data_cfg(tmp_path, f"text:{path}")
    assert as_text(load_tokens(cfg).train).startswith("first version")
    path.write_text("second edition, longer\n" * 100)
    assert as_text(load_tokens(cfg).train).startswith("second edition")


def test_an_edit_keeping_size_and_mtime_still_retokenizes(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("aaaa\n" * 200)
    stat = path.stat()
    cfg = data_cfg(tmp_path, f"text:{path}")
    assert set(as_text(load_tokens(cfg).train)) == {"a", "\n"}
    path.write_text("bbbb\n" * 200)  # same size ...
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and same mtime: only the content differs
    assert set(as_text(load_tokens(cfg).train)) == {"b", "\n"}


def test_the_cache_still_serves_an_unchanged_file(tmp_path, monkeypatch):
    path = tmp_path / "corpus.txt"
    path.write_text("unchanged\n" * 100)
    cfg = data_cfg(tmp_path, f"text:{path}")
    first = load_tokens(cfg)

    def no_text(_cfg):
        raise AssertionError("tokenized again although the file did not change")
    monkeypatch.setattr(corpus_module, "load_text", no_text)
    assert np.array_equal(load_tokens(cfg).train, first.train)


@pytest.mark.parametrize("victim", ["train.npy", "val.npy"])
def test_a_token_file_deleted_under_its_metadata_is_rebuilt(tmp_path, victim):
    path = tmp_path / "corpus.txt"
    path.write_text("some text to tokenize\n" * 100)
    cfg = data_cfg(tmp_path, f"text:{path}")
    first = load_tokens(cfg)
    [meta] = (cache_dir(cfg) / "tokens").glob("*/meta.json")
    (meta.parent / victim).unlink()
    second = load_tokens(cfg)
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert (meta.parent / victim).is_file()


def test_corrupt_token_cache_metadata_is_rebuilt(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("some text to tokenize\n" * 100)
    cfg = data_cfg(tmp_path, f"text:{path}")
    first = load_tokens(cfg)
    [meta] = (cache_dir(cfg) / "tokens").glob("*/meta.json")
    meta.write_text("{not json")
    assert np.array_equal(load_tokens(cfg).train, first.train)


# --- Tests never write into ../shared ------------------------------------------------------------------

def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_tinyshakespeare_tests_leave_the_shared_data_folder_alone(shakespeare_dir, tmp_path, monkeypatch):
    """The suite's tinyshakespeare run reads ../shared/data but writes its token cache elsewhere."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_data", REPO / "tests" / "data" / "test_data.py")
    test_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_data)  # by path: this file may run without tests/data collected
    run = test_data.test_tinyshakespeare_from_a_data_dir_without_download
    given = {"shakespeare_dir": shakespeare_dir, "tmp_path": tmp_path, "monkeypatch": monkeypatch}
    before = _tree(shakespeare_dir)
    cache_existed = (shakespeare_dir / "cache").exists()
    run(**{name: given[name] for name in inspect.signature(run).parameters})
    assert _tree(shakespeare_dir) == before
    assert cache_existed or not (shakespeare_dir / "cache").exists()
