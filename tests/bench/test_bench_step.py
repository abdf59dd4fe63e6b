"""`make bench-step` end to end at a toy size: every row trains (bare, tuned, gptpar and each fast-path option
switched), the table shows each row's ratio to the tuned loop, and the last line is the one the issue asks for."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_step  # noqa: E402


@pytest.mark.slow  # seven trainers and loops built and stepped, and the recorder's two ranks: about 20 s
def test_bench_step_times_every_row_and_ends_with_the_two_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    bench_step.main(["--preset", "gpt2-tiny", "--seq", "16", "--batch", "2", "--vocab", "300", "--warmup", "0",
                     "--rounds", "1", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    recorder = next(i for i, line in enumerate(lines) if line.startswith("The flight recorder"))
    rows = [line for line in lines[:recorder] if line.startswith("| ") and not line.startswith("| row")]
    names = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert names == ["bare", "tuned", "gptpar", "gptpar train.fused_optimizer=false", "gptpar model.pad_vocab=1",
                     "gptpar train.loss_kernel=plain", "gptpar log.sync_every=10"]
    assert all(re.search(r"\| n/a \(unknown peak for cpu\) \| n/a \| \d+\.\d\dx \|$", row) for row in rows), rows
    assert "not compiled" in lines[0] + lines[1]
    # the flight recorder on and off, side by side on each of two ranks, and its share of a step
    ranks = [line for line in lines[recorder:] if re.match(r"\| \d \|", line)]
    assert [row.split(" | ")[0] for row in ranks] == ["| 0", "| 1"], ranks
    assert all(re.search(r"\| \d+\.\d{3} \| \d+ \| [\d.]+ / [\d.]+ \| [\d.]+% \|$", row) for row in ranks), ranks
    assert re.fullmatch(r"gptpar/tuned: \d+\.\d\dx, gptpar/bare: \d+\.\d\dx", lines[-1]), lines[-1]
