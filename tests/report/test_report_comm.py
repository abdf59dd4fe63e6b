"""Compressed communication in the report: the bytes each parallel.grad_comm sent per step, their ratio to fp32 and
the step time beside them, in summary.md, summary.csv and a figure; categories in a meaningful order (fp32 first,
then by bytes), drawn as bars."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from logsets import T0, comm_run
from matplotlib.figure import Figure

from analysis.report import report

LATER = T0 + 3600.0
STEP_S = {"fp32": 1.0, "bf16": 0.9, "int8": 1.2}  # int8's quantisation costs more than its bytes save on a CPU


def heights(ax) -> list[float]:
    """An axes' bars, left to right."""
    return [bar.get_height() for bar in sorted(ax.patches, key=lambda bar: bar.get_x())]


def comm_sweep(runs: Path) -> None:
    """Sweep `comm`: dp=2 in fp32, bf16 and int8, folders in alphabetical order (bf16 first)."""
    for grad_comm, seconds in STEP_S.items():
        comm_run(runs / "comm" / grad_comm, grad_comm, seconds)


def test_the_summary_shows_bytes_per_step_their_ratio_to_fp32_and_the_step_time(tmp_path: Path) -> None:
    comm_sweep(tmp_path / "runs")
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER, warmup_steps=1)
    summary = result.summary_md.read_text()
    assert "## Communication per step, by `parallel.grad_comm`" in summary
    rows = [line.split(" | ") for line in summary.split("## Communication per step")[1].splitlines()
            if line.startswith("| comm |")]
    # fp32 first, then by bytes: 5.4, 2.7, 1.37 MB (int8: 0.685 + 0.685); step times of 1000, 900, 1200 ms.
    assert [row[2:7] for row in rows] == [
        ["fp32", "5.4", "all_reduce 5.4", "1.000×", "1000.0 ± 0.0"],
        ["bf16", "2.7", "all_reduce 2.7", "0.500×", "900.0 ± 0.0"],
        ["int8", "1.37", "all_gather 0.685, all_to_all 0.685", "0.254×", "1200.0 ± 0.0"]]
    main = [line.split(" | ")[1] for line in summary.split("\n## ")[0].splitlines() if line.startswith("| comm |")]
    assert main == ["grad_comm=fp32", "grad_comm=bf16", "grad_comm=int8"]
    with open(result.summary_csv, newline="") as f:
        table = {row["run"]: row for row in csv.DictReader(f)}
    assert [(table[f"comm/{g}"]["grad_comm"], table[f"comm/{g}"]["comm_bytes_per_step"],
             table[f"comm/{g}"]["comm_bytes_vs_fp32"]) for g in STEP_S] == [
        ("fp32", "5400000", "1"), ("bf16", "2700000", "0.5"), ("int8", "1370000", "0.253703703704")]


def test_categories_are_bars_fp32_first_then_by_bytes(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    comm_sweep(tmp_path / "runs")
    report(tmp_path / "runs", tmp_path / "out", now=LATER, warmup_steps=1)
    fig = drawn["throughput_vs_grad_comm.png"]
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fp32", "bf16", "int8"]
    assert not [line for line in ax.get_lines() if line.get_marker() == "o"]  # bars, not a line through categories
    assert [round(height, 1) for height in heights(ax)] == [200.0, 222.2, 166.7]  # 200 tokens a step
    bytes_ax, time_ax = drawn["communication_comm.png"].axes
    assert [t.get_text() for t in bytes_ax.get_xticklabels()] == ["fp32", "bf16", "int8"]
    assert heights(bytes_ax) == pytest.approx([5.4, 2.7, 1.37])
    assert [t.get_text() for t in sorted(bytes_ax.texts, key=lambda t: t.xy[0])] == ["1.00×", "0.50×", "0.25×"]
    assert heights(time_ax) == pytest.approx([1000.0, 900.0, 1200.0])
    assert "parallel.grad_comm" in drawn["communication_comm.png"]._suptitle.get_text()
