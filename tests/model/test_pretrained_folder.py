"""model.init=pretrained:PATH: a save_pretrained folder's weights and tokenizer, offline.

Folders written here with transformers itself: a Qwen2 (tied head) whose tokenizer has a chat template, and a
Llama (untied head) whose tokenizer has none, whole and as safetensors shards with their index. In-process: the
config's shape is the folder's, the weights load unchanged, sft pairs are framed by the chat template (or the plain
template with the folder's end token), a long question is cut to fit, the submit side makes the folder absolute,
and bad folders or settings are one line. On the shared gloo pool: sft from the Qwen2 folder under tensor
parallelism and fsdp2 trains like one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_pool import GlooPools
from hostile_pickle import CALLED, RunsCode
from rank_training import BASE, assert_trains_like_one_process, make_config, reference_run, save_cases, saved_ranks
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from analysis.mfu import model_shape
from gptpar.config import ConfigError, data_config, load_config
from gptpar.data.pair_files import SAMPLES, read_pairs
from gptpar.data.pairs import IGNORE, load_pairs
from gptpar.data.tokenizer import pretrained_tokenizer
from gptpar.errors import GptparError
from gptpar.launch.prepare import prepare_run
from gptpar.models.build import build_model
from gptpar.presets import ModelShape

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)
SFT = ["data.task=sft", "data.source=metamath_sample", "data.max_source_len=48", "data.max_target_len=32"]


def _save_folder(folder: Path, family: str, shards: bool = False) -> Path:
    """A tiny model of `family` with a BPE trained on the bundled sample: qwen2 with a chat template whose end of
    turn is the end token, llama without one; `shards`: safetensors shards with their index."""
    text = (SAMPLES / "metamath_sample.ndjson").read_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    if family == "qwen2":
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", chat_template=CHAT
                                ).save_pretrained(folder)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=448, tie_word_embeddings=True, **SHAPE))
    else:
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=400, tie_word_embeddings=False, **SHAPE))
    model.save_pretrained(folder, max_shard_size="40KB" if shards else "5GB")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("folders")
    folders = {family: _save_folder(root / family, family) for family in ("qwen2", "llama")}
    return {**folders, "llama-shards": _save_folder(root / "llama-shards", "llama", shards=True)}


@pytest.mark.parametrize("folder", ["qwen2", "llama", "llama-shards"])
def test_the_config_has_the_folders_shape_and_the_weights_load_unchanged(folders: dict[str, Path],
                                                                         folder: str) -> None:
    family = folder.split("-")[0]
    if folder.endswith("shards"):
        assert len(list(folders[folder].glob("model-*-of-*.safetensors"))) > 1
    cfg = load_config(None, [f"model.init=pretrained:{folders[folder]}"])
    assert cfg.model.shape() == ModelShape(family, 2, 32, 4, 128, n_kv_head=2, n_inner=64, tied=family == "qwen2")
    model = build_model(cfg.model, 400, seed=1, seq_len=64)
    saved = type(model).from_pretrained(folders[folder])
    assert model.state_dict().keys() == saved.state_dict().keys()
    for name, value in model.state_dict().items():  # llama's 400 rows are padded to 448 (model.pad_vocab), with zeros
        rows = saved.state_dict()[name].size(0)
        assert torch.equal(value[:rows], saved.state_dict()[name]) and not value[rows:].any(), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (family == "qwen2")
    ids = torch.randint(0, 400, (2, 12))
    assert torch.equal(model(ids).logits[..., :400], saved(ids).logits[..., :400])  # the same weights, the same model


def test_sft_pairs_are_framed_by_the_folders_chat_template(folders: dict[str, Path]) -> None:
    cfg = load_config(None, [f"model.init=pretrained:{folders['qwen2']}", *SFT, "data.max_source_len=90"])
    data, (question, answer) = load_pairs(data_config(cfg)), read_pairs(data_config(cfg)).train[0]
    tokenizer = data.tokenizer
    assert data.vocab_size == tokenizer.vocab_size == 400  # no ids added to the folder's table
    assert tokenizer.encode_each(["<|im_end|>"])[0].tolist() == [data.eos]  # the tokenizer's own end token
    prompt, response = data.train.prompts[0].tolist(), data.train.responses[0].tolist()
    assert tokenizer.decode(prompt) == f"user\n{question}\nassistant\n"  # decoded text leaves special tokens out
    assert (answer + "\n").startswith(tokenizer.decode(response)) and data.eos in response[-2:]
    x, y = data.train[0]
    assert x.tolist() == [*prompt, *response][:-1]
    assert y.tolist() == [IGNORE] * (len(prompt) - 1) + response  # only the response (its end too) is predicted


def test_without_a_chat_template_the_plain_template_uses_the_folders_end_token(folders: dict[str, Path]) -> None:
    cfg = load_config(None, [f"model.init=pretrained:{folders['llama']}", *SFT])
    data = load_pairs(data_config(cfg))
    eos = data.tokenizer.encode_each(["<|endoftext|>"])[0].tolist()
    assert [data.eos] == eos and data.vocab_size == 400
    question, answer = data.tokenizer.encode_each([data.train.references[0]])[0], data.train.responses[0]
    assert data.train.prompts[0][-1] == data.eos and answer[-1] == data.eos  # prompt <eos> response <eos>
    assert np.array_equal(answer[:-1], question[:32])


def test_a_long_question_is_cut_so_that_the_templated_prompt_fits(folders: dict[str, Path]) -> None:
    cfg = load_config(None, [f"model.init=pretrained:{folders['qwen2']}", *SFT, "data.max_source_len=30"])
    data = load_pairs(data_config(cfg))  # the template's own tokens are 18 of them
    assert max(len(p) for p in data.train.prompts) == 30
    assert all(data.tokenizer.decode(p.tolist()).endswith("assistant\n") for p in data.train.prompts)
    short = load_config(None, [f"model.init=pretrained:{folders['qwen2']}", *SFT, "data.max_source_len=10"])
    with pytest.raises(GptparError, match=r"^data.max_source_len=10 leaves no room for the question: the chat "
                                          r"template of data.tokenizer=pretrained:.* takes 18 tokens itself; raise "
                                          r"data.max_source_len$"):
        load_pairs(data_config(short))


def test_submitting_makes_the_folder_absolute_for_the_ranks(folders: dict[str, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(folders["qwen2"].parent)
    cfg = load_config(None, ["model.init=pretrained:qwen2", *SFT, f"log.runs_dir={tmp_path}"])
    planned = prepare_run(cfg, write=False).cfg
    assert planned.model.init == planned.data.tokenizer == f"pretrained:{folders['qwen2']}"


def test_the_reports_flops_count_the_folders_shape(folders: dict[str, Path], tmp_path: Path) -> None:
    params = {"model.init": f"pretrained:{folders['llama']}", "model.preset": "gpt2-tiny", "data.seq_len": 64}
    shape = model_shape(params, 400)
    assert shape is not None and shape.model == load_config(None, [f"model.init={params['model.init']}"]).model.shape()
    assert model_shape({**params, "model.init": f"pretrained:{tmp_path / 'gone'}"}, 400) is None  # no guess


def _broken(folders: dict[str, Path], tmp_path: Path, what: str) -> Path:
    folder = tmp_path / what
    shutil.copytree(folders["qwen2"], folder)
    if what == "no-weights":
        (folder / "model.safetensors").unlink()
    elif what == "no-response":
        (folder / "chat_template.jinja").write_text(CHAT.replace("{{ m['content'] }}", "{% if m['role'] == 'user' %}"
                                                                 "{{ m['content'] }}{% endif %}"))
    elif what in ("empty-weights", "truncated-weights", "corrupt-weights"):
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes({"empty-weights": b"", "truncated-weights": data[:len(data) // 2],
                             "corrupt-weights": data[:8] + b"x" * 32 + data[40:]}[what])
    elif what == "corrupt-bin":
        (folder / "model.safetensors").unlink()
        (folder / "pytorch_model.bin").write_bytes(b"garbage" * 100)
    elif what == "small-table":  # config.json edited: its table no longer covers the folder's own tokenizer
        config = folder / "config.json"
        config.write_text(config.read_text().replace('"vocab_size": 448', '"vocab_size": 300'))
    elif what == "mistral":
        config = folder / "config.json"
        config.write_text(config.read_text().replace('"model_type": "qwen2"', '"model_type": "mistral"'))
    return folder


@pytest.mark.parametrize(("what", "overrides", "message"), [
    ("no-weights", [], "the folder has no weights (one of model.safetensors, model.safetensors.index.json, "
                       "pytorch_model.bin, pytorch_model.bin.index.json); save the model there with save_pretrained"),
    ("mistral", [], "config.json describes a 'mistral' model; gptpar trains gpt2, llama, qwen2"),
    ("missing", [], ": no such folder; name a folder written by transformers' save_pretrained"),
    ("ok", ["model.n_layer=4"], "model.n_layer=4: the weights of model.init=pretrained:"),
    ("ok", ["data.tokenizer=bytes"], "data.tokenizer=bytes: the weights of model.init=pretrained:"),
    ("ok", ["data.task=translation", "data.source=jsonl:x.jsonl"], "adds two tokens (<sep>, <eos>)"),
    ("ok", ["model.init_device=meta"], "model.init=pretrained loads real weights and cannot use "
                                       "model.init_device=meta"),
])
def test_a_folder_that_cannot_be_trained_is_one_line(folders: dict[str, Path], tmp_path: Path, what: str,
                                                     overrides: list[str], message: str) -> None:
    folder = folders["qwen2"] if what == "ok" else tmp_path / what if what == "missing" else \
        _broken(folders, tmp_path, what)
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"model.init=pretrained:{folder}", *overrides])
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("what", "reason"), [
    ("empty-weights", "SafetensorError: Error while deserializing header: header too small"),
    ("truncated-weights", "SafetensorError: Error while deserializing header: incomplete metadata"),
    ("corrupt-weights", "SafetensorError: Error while deserializing header: invalid JSON in header"),
    ("corrupt-bin", "UnpicklingError: Weights only load failed)"),
])
def test_weights_that_cannot_be_read_are_one_line(folders: dict[str, Path], tmp_path: Path, what: str,
                                                  reason: str) -> None:
    folder = _broken(folders, tmp_path, what)
    cfg = load_config(None, [f"model.init=pretrained:{folder}"])
    with pytest.raises(GptparError) as error:
        build_model(cfg.model, 400, seed=1, seq_len=64)
    message = str(error.value)
    assert message.startswith(f"model.init=pretrained:{folder}: its weights cannot be loaded ({reason}")
    assert message.endswith("; save them again with save_pretrained") and "\n" not in message


def test_a_token_table_too_small_for_the_ids_names_the_real_cause(folders: dict[str, Path], tmp_path: Path) -> None:
    """Both said "use the folder's own tokenizer (data.tokenizer=auto)", which was already the setting."""
    with pytest.raises(ConfigError) as error:  # synthetic data draws ids below data.vocab_size, 4096 by default
        load_config(None, [f"model.init=pretrained:{folders['qwen2']}", "data.source=synthetic"])
    assert str(error.value) == (f"data.vocab_size=4096: data.source=synthetic draws token ids below it, but the token "
                                f"table of model.init=pretrained:{folders['qwen2']} has 448 rows; use "
                                "data.vocab_size=448 or less")
    load_config(None, [f"model.init=pretrained:{folders['qwen2']}", "data.source=synthetic", "data.vocab_size=448"])
    folder = _broken(folders, tmp_path, "small-table")
    with pytest.raises(GptparError) as error:
        build_model(load_config(None, [f"model.init=pretrained:{folder}"]).model, 400, seed=1, seq_len=64)
    assert str(error.value) == (f"model.init=pretrained:{folder}: its token table has 300 rows (vocab_size in its "
                                "config.json), fewer than the 400 ids of its own tokenizer: config.json does not "
                                "describe these weights (was it edited?); save the model and its tokenizer again with "
                                "save_pretrained")


@pytest.mark.parametrize("key", ["model.init", "data.tokenizer"])
def test_a_file_or_no_path_for_a_folder_is_one_line(folders: dict[str, Path], key: str) -> None:
    config = folders["qwen2"] / "config.json"
    with pytest.raises(ConfigError, match=rf"^{key}=pretrained:{config}: is a file, not a folder"):
        load_config(None, [f"{key}=pretrained:{config}"])
    with pytest.raises(ConfigError, match=rf"^{key}=pretrained: names no folder; use pretrained:PATH "):
        load_config(None, [f"{key}=pretrained:"])


@pytest.mark.parametrize(("key", "value"), [("model.init", "pretrained-ish"), ("data.tokenizer", "sentencepiece")])
def test_an_unknown_weights_or_tokenizer_kind_is_one_line(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}={value!r} is not allowed; use .*pretrained:PATH$"):
        load_config(None, [f"{key}={value}"])


def test_a_chat_template_that_drops_the_response_is_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _broken(folders, tmp_path, "no-response")
    cfg = load_config(None, [f"model.init=pretrained:{folder}", *SFT])
    with pytest.raises(GptparError) as error:
        load_pairs(data_config(cfg))
    assert str(error.value) == (f"data.tokenizer=pretrained:{folder}: its chat template drops the response (a user "
                                "turn and an assistant turn render without the assistant's text after the prompt); "
                                "fix chat_template in tokenizer_config.json, or delete it to use the plain template")


def test_weights_that_would_run_code_are_refused_in_one_line_and_run_none(folders: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """A pytorch_model.bin is a pickle: it is read with torch.load(weights_only=True), so one that names a function
    (here io.open, creating the marker) is refused before the function is called."""
    folder, marker = tmp_path / "hostile", tmp_path / "MARK"
    shutil.copytree(folders["llama"], folder)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": RunsCode(marker)}, folder / "pytorch_model.bin")
    cfg = load_config(None, [f"model.init=pretrained:{folder}"])
    with pytest.raises(GptparError) as error:
        build_model(cfg.model, 400, seed=1, seq_len=64)
    assert not marker.exists()
    assert str(error.value) == (f"model.init=pretrained:{folder}: refused to load its weights: they name {CALLED}, "
                                "which weights never hold (loading them could run code); save the model there again "
                                "with save_pretrained, from a source you trust")


def test_a_tokenizer_with_its_own_code_is_refused_even_if_the_user_says_yes(folders: dict[str, Path], tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer_config.json whose auto_map names a class in the folder's own Python: transformers asks on a
    terminal whether to run it (a user may press y) unless told no, which gptpar does."""
    folder, marker = tmp_path / "own-code", tmp_path / "MARK"
    shutil.copytree(folders["llama"], folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "OwnTokenizer",
                                  "auto_map": {"AutoTokenizer": [None, "own.OwnTokenizer"]}}))
    (folder / "own.py").write_text(f"open({str(marker)!r}, 'w')\n")
    monkeypatch.setattr("builtins.input", lambda prompt: "y")  # the user's answer at transformers' prompt
    with pytest.raises(GptparError) as error:
        pretrained_tokenizer(folder)
    assert not marker.exists()
    assert str(error.value).startswith(f"data.tokenizer=pretrained:{folder}: the tokenizer cannot be loaded (")
    assert "\n" not in str(error.value)


PRETRAINED_CASES = [("tp2", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                    ("fsdp2", ["parallel.dp=2", "parallel.dp_sync=fsdp2"])]


@pytest.mark.slow
def test_sft_from_a_folder_trains_like_one_process(folders: dict[str, Path], tmp_path: Path,
                                                   gloo_pool: GlooPools) -> None:
    base = [o for o in BASE if not o.startswith("model.")]  # the folder fixes the shape
    cases = [(name, [f"model.init=pretrained:{folders['qwen2']}", *SFT, *overrides])
             for name, overrides in PRETRAINED_CASES]
    gloo_pool.run(2, save_cases, tmp_path, cases, base)
    ref = reference_run(make_config(cases[0][1], tmp_path, "reference", base))
    for name, _ in cases:
        assert_trains_like_one_process(ref, saved_ranks(tmp_path, name), "model.embed_tokens.weight", name)
