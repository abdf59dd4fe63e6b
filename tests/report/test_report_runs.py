"""Which runs a report lists, and by what name: standalone runs by their run ids, runs still in progress left out
and counted unless asked for (--include-running), and a runs folder nested in the reported one (runs/demo, made by
`--runs-dir runs/demo`) left to its own report."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from logsets import T0, Rank, config, dp_run

from analysis.report import report
from gptpar.cli import main as gptpar_main
from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder
from gptpar.run.sweeps import write_sweep_record

LATER = T0 + 3600.0


def listed(path: Path) -> list[str]:
    """The runs summary.csv lists."""
    with open(path, newline="") as f:
        return [row["run"] for row in csv.DictReader(f)]


def table_points(summary: str) -> list[str]:
    """The point column of summary.md's main table."""
    return [line.split(" | ")[1] for line in summary.split("\n## ")[0].splitlines()
            if line.startswith("| ") and not line.startswith(("| sweep", "|---"))]


def demo_folder(runs: Path) -> Path:
    """runs/demo as `gptpar sweep ... --runs-dir runs/demo` leaves it: a sweep folder with its record and a run."""
    sweep = runs / "demo" / "demo_dp"
    dp_run(sweep / "dp1", [100.0])
    write_sweep_record(sweep, "demo_dp", "dp", [], [], {})
    return runs / "demo"


def test_standalone_runs_are_named_by_their_run_ids(tmp_path: Path) -> None:
    dp_run(tmp_path / "tr1", [100.0], **{"train.lr": 0.001, "train.batch_size": 8})
    dp_run(tmp_path / "tr2", [100.0, 100.0], **{"train.lr": 0.002, "model.n_layer": 4})
    summary = report(tmp_path, tmp_path / "out", now=LATER).summary_md.read_text()
    assert table_points(summary) == ["tr1", "tr2"]  # not "dp=1, batch_size=8, lr=0.001, n_layer=..."


def test_runs_in_progress_are_left_out_and_counted_unless_asked_for(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    dp_run(tmp_path / "s" / "done", [100.0])
    Rank(tmp_path / "s" / "live", 0, config()).header().step(1)
    with RunFolder(tmp_path / "s" / "live").hold("123"):  # its process is alive: its lock says so
        result = report(tmp_path, tmp_path / "out", now=LATER)
        assert listed(result.summary_csv) == ["s/done"] and [r.run for r in result.runs] == ["s/done"]
        summary = result.summary_md.read_text()
        assert "Left out: 1 run(s) still in progress (s/live); `--include-running` lists them." in summary
        assert summary.count("s/live") == 1
        assert gptpar_main(["report", str(tmp_path), "--out", str(tmp_path / "cli"), "--include-running"]) == 0
        assert listed(tmp_path / "cli" / "summary.csv") == ["s/done", "s/live"]
        assert "| s/live | running |" in (tmp_path / "cli" / "summary.md").read_text()
    assert "left out" not in capsys.readouterr().out


def test_a_nested_runs_folder_is_left_to_its_own_report(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    dp_run(runs / "s" / "a", [100.0])
    demo = demo_folder(runs)
    result = report(runs, tmp_path / "out", now=LATER)
    assert [r.run for r in result.runs] == ["s/a"]
    assert f"Left out: {demo} holds sweeps of its own (1 run(s); `gptpar report {demo}`)." in (
        result.summary_md.read_text())
    assert [r.run for r in report(demo, tmp_path / "demo", now=LATER).runs] == ["demo_dp/dp1"]
    bare = demo_folder(tmp_path / "bare").parent  # nothing of its own: the error says where the runs are
    with pytest.raises(GptparError, match=r"no run folders of its own under .*bare'.*demo holds sweeps of its own"):
        report(bare, tmp_path / "out", now=LATER)
