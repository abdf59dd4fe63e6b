"""The planner prices a data-parallel strategy by its row alone: a row copied under another name predicts exactly as
the original (no branch on a strategy's name), a row without pricing is refused in one line and never searched."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from planfix import calibration, layout, machine_calibration, network

from gptpar.cli import main
from gptpar.plan.predict import predict
from gptpar.plan.search import candidates
from gptpar.strategies.data_parallel import DP_STRATEGIES, DataParallelStrategy

WORDS = ["model.preset=gpt2-tiny", "data.source=synthetic", "data.vocab_size=4096", "data.seq_len=64",
         "train.precision=fp32"]
UNPRICED = DataParallelStrategy("tests.example:Sync", "an example without pricing")


@pytest.mark.parametrize("name", [name for name, row in DP_STRATEGIES.items() if row.pricing is not None])
@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the step as it is added up on a CPU, and with overlap on a GPU
def test_a_row_under_another_name_predicts_the_same(name: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(DP_STRATEGIES, "copy", dataclasses.replace(DP_STRATEGIES[name]))
    words = ("model.preset=gpt2-tiny", "data.seq_len=64", "train.batch_size=16", "parallel.dp=2",
             "train.grad_accum=2", "parallel.bucket_mb=0.01")
    tp = ("parallel.tp=2", "parallel.tp_impl=torch") if DP_STRATEGIES[name].tensor_parallel == ("torch",) else ()
    original, copy = (layout(*words, *tp, f"parallel.dp_sync={sync}") for sync in (name, "copy"))
    calib = calibration(original, device=device, device_name="TestGPU")
    net = network(1e-4, 1e9)
    assert predict(copy, calib, net, "TestGPU").to_dict() == predict(original, calib, net, "TestGPU").to_dict()


def test_a_row_without_pricing_is_refused_in_one_line_and_not_searched(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(DP_STRATEGIES, "unpriced", UNPRICED)
    calib = str(machine_calibration(tmp_path / "calib.json"))
    code = main(["plan", "predict", *WORDS, "parallel.dp=2", "parallel.dp_sync=unpriced", "--calibration", calib])
    assert (code, capsys.readouterr().err) == (2, (
        "gptpar: error: parallel.dp_sync=unpriced has no pricing in its row (gptpar/strategies/data_parallel.py), so "
        "the planner cannot predict it; plan with parallel.dp_sync=naive, bucketed, ddp, zero1, zero2, fsdp or "
        "fsdp2\n"))
    assert "unpriced" not in {c["parallel.dp_sync"] for c in candidates(8, 8)}
