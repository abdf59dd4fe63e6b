"""A run continued on other layouts (--reshape) tells its story by segment (gptpar.run.segments): `gptpar status`
lists each layout's steps and throughput, the report tabulates them, and neither averages throughput across layouts.

The run is written by the log's own writer with known step times: dp=2 bucketed for steps 1-2, tp=2 for steps 3-4,
then one rank for steps 5-6 and, after a requeue on that layout, 7-8. Every step carries 100 tokens per rank.
"""

from __future__ import annotations

from pathlib import Path

from logsets import Rank, config

from analysis.report import run_table
from analysis.summary import markdown
from gptpar.cli import main as gptpar_main
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import RankLogger, read_rank_log
from gptpar.run.segments import Segment, layout_label, segments
from gptpar.run.state import read_run

DP2 = config(dp=2, **{"parallel.dp_sync": "bucketed", "launch.gpus": 2})
TP2 = config(dp=1, **{"parallel.tp": 2, "launch.gpus": 2})
ONE = config(dp=1, **{"launch.gpus": 1})
# dp=2: both ranks replicas, rank 1 the slowest (2 s a step): 2 x 100 tokens / 2 s. tp=2: rank 0 the replica, rank 1
# the slowest (4 s): 100 / 4. One rank: 100 tokens in 0.5 s, then (after the requeue) in 0.25 s: 400 / 1.5.
SEGMENTS = [Segment("dp=2 (bucketed)", 1, 2, 100.0), Segment("tp=2", 3, 4, 25.0), Segment("1 rank", 5, 8, 400 / 1.5)]


def _start(ranks: list[Rank], cfg: dict, sizes: dict, coords: list[dict], restart: int) -> None:
    """A start of `len(coords)` ranks after every record written so far (each rank's clock moves past them all)."""
    now = max(rank.clock for rank in ranks)
    for rank, where in zip(ranks, coords, strict=False):
        rank.cfg, rank.sizes, rank.coords, rank.clock = cfg, sizes, where, now
        rank.logger = RankLogger(rank.path.parent, rank.rank)  # the last start's final closed it
        rank.header(restart=restart)


def _steps(ranks: list[Rank], steps: range, times: list[float], status: str) -> None:
    for step in steps:
        for rank, seconds in zip(ranks, times, strict=False):
            rank.step(step, 0, step_time_s=seconds, tokens=100)
    for rank in ranks[:len(times)]:
        rank.final(status, steps[-1])


def reshaped_run(run: Path) -> None:
    ranks = [Rank(run, r, DP2) for r in range(2)]
    _start(ranks, DP2, {"dp": 2, "pp": 1, "tp": 1}, [{"dp": 0}, {"dp": 1}], 0)
    _steps(ranks, range(1, 3), [1.0, 2.0], "stopped")
    _start(ranks, TP2, {"dp": 1, "pp": 1, "tp": 2}, [{"tp": 0}, {"tp": 1}], 1)
    _steps(ranks, range(3, 5), [1.0, 4.0], "stopped")
    _start(ranks, ONE, {"dp": 1, "pp": 1, "tp": 1}, [{}], 2)  # rank 1 keeps its log: its last start was tp=2's
    _steps(ranks, range(5, 7), [0.5], "requeued")
    _start(ranks, ONE, {"dp": 1, "pp": 1, "tp": 1}, [{}], 3)
    _steps(ranks, range(7, 9), [0.25], "completed")


def test_segments_are_each_layouts_steps_and_throughput_on_its_own_ranks(tmp_path: Path) -> None:
    reshaped_run(tmp_path / "run")
    ranks = [read_rank_log(path) for path in RunFolder(tmp_path / "run").rank_logs()]
    assert segments(ranks) == SEGMENTS


def test_a_layout_in_a_few_words() -> None:
    """From a header's grid sizes and the config it ran: the dimensions above 1, then how they run."""
    config = {"parallel": {"pp_schedule": "1f1b", "dp_sync": "zero2"}, "train": {"grad_accum": 4}}
    assert layout_label({"sizes": {"pp": 2, "dp": 2, "cp": 1, "tp": 1, "ep": 2}, "config": config}) == (
        "pp=2 x dp=2 (1f1b, zero2, ep=2, grad_accum=4)")
    assert layout_label({"sizes": {"pp": 1, "dp": 1, "tp": 2}, "config": {}}) == "tp=2"


def test_a_run_that_shrank_is_as_its_current_ranks_say(tmp_path: Path) -> None:
    """Rank 1's log ends with the tp=2 start's stop; the run is what rank 0's start of one rank did: completed."""
    reshaped_run(tmp_path / "run")
    assert read_run(RunFolder(tmp_path / "run")).state == "completed"


def test_status_lists_the_segments_under_the_run(tmp_path: Path, capsys) -> None:
    reshaped_run(tmp_path / "run")
    assert gptpar_main(["status", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("completed  run") and lines[2].startswith("    note: it continued on another layout")
    assert lines[3:6] == ["    segment: steps 1-2 on dp=2 (bucketed): 100 tok/s",
                          "    segment: steps 3-4 on tp=2: 25 tok/s", "    segment: steps 5-8 on 1 rank: 267 tok/s"]


def test_the_report_tabulates_the_segments_and_times_the_run_on_its_last_layout(tmp_path: Path) -> None:
    reshaped_run(tmp_path / "run")
    runs, shown = run_table(tmp_path, warmup_steps=0)
    assert [r.segments for r in shown] == [SEGMENTS]
    assert shown[0].tokens_per_s[0] == 300.0  # the last layout's steps alone: 100 tokens in 0.5 s twice, 0.25 s twice
    text = markdown(runs, shown, tmp_path, "none")
    table = text.split("## Runs continued on other layouts (segments)\n\n")[1].split("\n\n")[1]
    assert table.splitlines() == [
        "| run | layout | steps | tokens/s |", "|---|---|---|---|", "| run | dp=2 (bucketed) | 1-2 | 100 |",
        "| run | tp=2 | 3-4 | 25 |", "| run | 1 rank | 5-8 | 267 |"]
