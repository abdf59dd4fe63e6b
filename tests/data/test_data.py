import functools
import http.server
import multiprocessing
import os
import shutil
import threading

import numpy as np
import pytest

from gptpar.config import DataConfig
from gptpar.data import BlockDataset, load_tokens, sources
from gptpar.data import corpus as corpus_module
from gptpar.data.tokenizer import bytes_tokenizer, trained_bpe
from gptpar.errors import GptparError
from gptpar.hub import hub_reachable


def test_stdlib_corpus_is_deterministic_and_bounded():
    first, second = sources.stdlib_text(50_000), sources.stdlib_text(50_000)
    assert first == second and len(first) == 50_000
    assert "def " in first and "import" in first


def test_synthetic_tokens_cover_the_vocabulary_range():
    splits = load_tokens(DataConfig(source="synthetic", vocab_size=300, synthetic_tokens=10_000))
    assert len(splits.train) == 9_000 and len(splits.val) == 1_000
    assert splits.train.min() >= 0 and splits.train.max() < 300 and splits.vocab_size == 300


def test_text_files_through_datasets(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("hello world\n" * 50)
    b.write_text("goodbye moon\n" * 50)
    splits = load_tokens(DataConfig(source=f"text:{a},{b}", tokenizer="bytes", val_fraction=0.1))
    assert splits.vocab_size == 256
    text = bytes(np.concatenate([splits.train, splits.val]).astype(np.uint8)).decode()
    assert text.startswith("hello world") and text.rstrip().endswith("goodbye moon")
    with pytest.raises(GptparError, match="data.source=text: .* does not exist"):
        load_tokens(DataConfig(source=f"text:{tmp_path}/missing.txt"))


def test_hf_source_offline_fails_with_one_clear_line():
    with pytest.raises(GptparError, match=r"data.source=hf:no-such/corpus: cannot load the dataset; "
                                          r"the Hugging Face hub is unreachable") as err:
        load_tokens(DataConfig(source="hf:no-such/corpus"))
    assert "\n" not in str(err.value)


def test_tinyshakespeare_from_a_data_dir_without_download(shakespeare_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TINYSHAKESPEARE_URL", "http://127.0.0.1:9/must-not-be-fetched")
    (tmp_path / "tinyshakespeare.txt").symlink_to(shakespeare_dir / "tinyshakespeare.txt")  # cache not in ../shared
    cfg = DataConfig(source="tinyshakespeare", dir=str(tmp_path), tokenizer="bytes", max_chars=0)
    splits = load_tokens(cfg)
    assert len(splits.train) + len(splits.val) == 1_115_394  # ASCII: one byte, one token


def test_tinyshakespeare_download_is_checked_and_cached(shakespeare_dir, tmp_path, monkeypatch):
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/input.txt"
    monkeypatch.setattr(sources, "TINYSHAKESPEARE_URL", url)
    cfg = DataConfig(source="tinyshakespeare", dir=str(tmp_path / "cache"))
    try:
        (served / "input.txt").write_text("not shakespeare")
        with pytest.raises(GptparError, match="sha256 does not match"):
            sources.tinyshakespeare_path(cfg)
        shutil.copy(shakespeare_dir / "tinyshakespeare.txt", served / "input.txt")
        path = sources.tinyshakespeare_path(cfg)
        assert sources.sha256_of(path) == sources.TINYSHAKESPEARE_SHA256
    finally:
        server.shutdown()
    assert sources.tinyshakespeare_path(cfg) == path  # the server is gone: served from the cache
    assert not list(path.parent.glob("*.part*"))


def test_tinyshakespeare_unreachable_says_how_to_provide_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TINYSHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")
    with pytest.raises(GptparError, match=r"copy the file to .*tinyshakespeare.txt or point GPTPAR_DATA_DIR"):
        sources.tinyshakespeare_path(DataConfig(dir=str(tmp_path)))


def test_second_load_uses_the_token_cache(monkeypatch):
    cfg = DataConfig(source="stdlib", max_chars=60_000, vocab_size=512)
    first = load_tokens(cfg)

    def no_text(_cfg):
        raise AssertionError("the corpus was read again instead of using the cache")
    monkeypatch.setattr(corpus_module, "load_text", no_text)
    second = load_tokens(cfg)
    assert np.array_equal(first.train, second.train) and isinstance(second.train, np.memmap)
    assert first.tokenizer.startswith("bpe-") and second.vocab_size == 512


def _load_and_count(cfg: DataConfig, counter: str, out: str) -> None:
    original = corpus_module.load_text

    def counted(c):
        with open(counter, "a") as f:
            f.write("tokenized\n")
        return original(c)
    corpus_module.load_text = counted
    np.save(out, np.asarray(load_tokens(cfg).train))


@pytest.mark.slow
def test_concurrent_ranks_tokenize_once(tmp_path):
    cfg = DataConfig(source="stdlib", max_chars=80_000, vocab_size=600, dir=str(tmp_path / "shared-fs"))
    counter = tmp_path / "count.txt"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_load_and_count, args=(cfg, str(counter), str(tmp_path / f"r{i}.npy")))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert counter.read_text().count("tokenized") == 1
    arrays = [np.load(tmp_path / f"r{i}.npy") for i in range(4)]
    assert all(np.array_equal(arrays[0], a) for a in arrays[1:])


def test_trained_bpe_is_cached_by_corpus_and_vocab(tmp_path):
    text = sources.stdlib_text(30_000)
    first = trained_bpe(text, 400, tmp_path)
    files = list(tmp_path.glob("bpe-*.json"))
    assert len(files) == 1 and first.vocab_size == 400
    again = trained_bpe(text, 400, tmp_path)
    assert again.name == first.name and np.array_equal(again.encode("def f(x):"), first.encode("def f(x):"))
    trained_bpe(text, 450, tmp_path)
    assert len(list(tmp_path.glob("bpe-*.json"))) == 2


def test_bytes_tokenizer_round_trips():
    tok = bytes_tokenizer()
    ids = tok.encode("héllo")
    assert tok.vocab_size == 256 and bytes(ids.astype(np.uint8)).decode() == "héllo"


def test_blocks_are_inputs_and_labels_shifted_by_one():
    ds = BlockDataset(np.arange(100, dtype=np.int32), seq_len=8)
    assert len(ds) == (100 - 1) // 8
    x, y = ds[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    with pytest.raises(GptparError, match="fewer than data.seq_len"):
        BlockDataset(np.arange(5, dtype=np.int32), seq_len=8)


def test_hub_probe_respects_offline_and_fails_fast(monkeypatch):
    hub_reachable.cache_clear()
    assert hub_reachable(0.5) is False  # HF_HUB_OFFLINE=1 from the fixture
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    hub_reachable.cache_clear()
    assert hub_reachable(0.5) is False
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # transformers/datasets will not retry the network
    hub_reachable.cache_clear()


def test_split_is_deterministic_by_position():
    train, val = corpus_module._split_text("abcdefghij", 0.2)
    assert (train, val) == ("abcdefgh", "ij")
