"""Hostile data (issue 26): files named twice, an example longer than the model's context, translation pairs that a
cap or a key leaves too few of. Each case is refused in one line naming the key or file at fault and the fix, before
anything trains on the wrong data; each test failed on the code before its fix.

In-process throughout: the real data functions on real files, the trainer's set-up, and `gptpar train`'s own main,
which must refuse before it makes a run folder or starts a rank (the conftest guard fails a test that starts one).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptpar.cli import main as gptpar_main
from gptpar.config import ConfigError, load_config

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "train.batch_size=8", "train.max_steps=2", "train.threads=1", "log.progress=none"]


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and len(message) < 400, message
    return message


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
