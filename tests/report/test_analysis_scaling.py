"""The numbers a reader trusts, on synthetic logs with hand-worked answers: job tokens/s behind speedup and
efficiency, repeats and their spread, the physical bounds flagged beyond the measured noise, progress in tokens
and time, validation and BLEU from epoch records, and the notebook loader."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
from logsets import T0, Rank, config, dp_run

from analysis.aggregate import EpochPoint, RunMetrics
from analysis.grouping import Mark, marks, series
from analysis.report import analyse_runs, report
from gptpar.errors import GptparError

LATER = T0 + 3600.0


def metrics(runs_dir: Path, **kwargs) -> dict[str, RunMetrics]:
    return {m.run: m for m in analyse_runs(runs_dir, now=LATER, **kwargs)}


def table_row(summary: str, point: str) -> list[str]:
    """The cells of the main table's row of a sweep point."""
    main = summary.split("\n## ")[0]
    return next(line for line in main.splitlines() if line.split(" | ")[1:2] == [point]).split(" | ")


def test_progress_counts_all_replicas_tokens_and_the_slowest_ranks_time(tmp_path: Path) -> None:
    dp_run(tmp_path / "r", [100.0, 50.0])  # rank 0's steps take 1 s, rank 1's 2 s; 100 tokens each
    m = metrics(tmp_path)["r"]
    assert m.progress == {1: (200, 2.0), 2: (400, 4.0), 3: (600, 6.0), 4: (800, 8.0)}
    # The epoch records' val_loss stands at each epoch's last step (no eval records here).
    assert m.val_curve == [(2, 2.0), (4, 2.0)]
    assert m.epoch_points == [EpochPoint(1, 2, 2.0, None), EpochPoint(2, 4, 2.0, None)]
    # Kept epoch 2: 2 replicas x 2 steps x 100 tokens over the slow rank's 4 s; the summed rates say 150.
    assert m.job_tokens_per_s == 100.0 and m.tokens_per_s == (150.0, None) and m.job_tokens_std is None


def test_an_eval_record_wins_over_the_epoch_record_at_the_same_step(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "r", 0, config()).header()
    rank.step(1).step(2).eval(2, 2.5).epoch(1, 2.0, 100.0, steps=2, val_loss=2.4).final(step=2)
    assert metrics(tmp_path)["r"].val_curve == [(2, 2.5)]


def test_job_tokens_spread_is_over_the_kept_epochs(tmp_path: Path) -> None:
    rank = Rank(tmp_path / "r", 0, config()).header()
    for epoch, seconds in ((1, 5.0), (2, 1.0), (3, 2.0)):  # epoch 1 is the warm-up
        rank.step(2 * epoch - 1, epoch, step_time_s=seconds).step(2 * epoch, epoch, step_time_s=seconds)
        rank.epoch(epoch, 2 * seconds, 100 / seconds, steps=2)
    rank.final(step=6)
    m = metrics(tmp_path)["r"]
    # Epoch 2: 200 tokens in 2 s, epoch 3: 200 in 4 s; over both 400 in 6 s.
    assert m.job_tokens_per_s == pytest.approx(400 / 6)
    assert m.job_tokens_std == pytest.approx(math.sqrt(2 * 25.0 ** 2))


def test_speedup_and_efficiency_use_job_tokens_not_summed_rates(tmp_path: Path) -> None:
    dp_run(tmp_path / "s" / "dp1", [100.0])
    dp_run(tmp_path / "s" / "dp2", [100.0, 50.0])  # the ranks' rates sum to 150, but the job waits for the slow one
    result = report(tmp_path, tmp_path / "out", now=LATER)
    dp2 = {m.run: m for m in result.runs}["s/dp2"]
    assert dp2.tokens_per_s[0] == 150.0 and dp2.job_tokens_per_s == 100.0
    assert (dp2.speedup, dp2.efficiency, dp2.ideal_speedup) == (1.0, 0.5, 2.0)
    assert table_row(result.summary_md.read_text(), "dp=2")[10:12] == ["1.00× vs dp=1", "50%"]


def repeats(root: Path) -> None:
    """Sweep rep: dp1 three times at 100 tokens/s, dp2 three times at 180, 190 and 200 job tokens/s."""
    for i, rate in enumerate((90.0, 95.0, 100.0)):
        dp_run(root / "rep" / f"dp1-r{i}", [100.0], **{"launch.repeat": i})
        dp_run(root / "rep" / f"dp2-r{i}", [rate, rate], **{"launch.repeat": i})


def test_repeats_are_one_point_with_their_spread(tmp_path: Path) -> None:
    repeats(tmp_path / "runs")
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    first = by["rep/dp2-r0"]
    assert (first.repeats, first.noise, first.noise_basis) == (3, pytest.approx(20 / 190), "min-max over 3 repeats")
    assert (first.speedup, first.baseline, first.baseline_runs) == (pytest.approx(1.8), "dp1-r0", 3)
    summary = result.summary_md.read_text()
    # One row for the point: its repeat count, the mean (min – max), the baseline named as what it is.
    row = table_row(summary, "dp=2")
    assert (row[2], row[9], row[10]) == ("3", "190 (180 – 200)", "1.90 (1.80 – 2.00)× vs mean of 3 repeats of dp=1")
    assert sum(line.startswith("| rep | dp=") for line in summary.splitlines()) == 2
    assert "| rep | dp1-r0, dp1-r1, dp1-r2 | 3 | 100 | 100 – 100 | 0 | 0.0% |" in summary
    assert "| rep | dp2-r0, dp2-r1, dp2-r2 | 3 | 190 | 180 – 200 | 10 | 10.5% |" in summary
    # In a figure the repeats are one point: their mean, the error bar from the lowest to the highest.
    lines = series(result.shown, "gpus")
    assert list(lines) == ["rep"]
    points = marks(lines["rep"], "gpus", lambda r: (r.job_tokens_per_s, r.job_tokens_std))
    assert [(m.x, m.y, m.low, m.high, len(m.runs)) for m in points] == [
        (1, 100.0, 100.0, 100.0, 3), (2, pytest.approx(190.0), pytest.approx(180.0), pytest.approx(200.0), 3)]
    assert isinstance(points[0], Mark) and points[1].repeated


def test_no_summary_spread_without_repeats(tmp_path: Path) -> None:
    dp_run(tmp_path / "s" / "dp1", [100.0])
    dp_run(tmp_path / "s" / "dp2", [90.0, 90.0])
    result = report(tmp_path, tmp_path / "out", now=LATER)
    assert "Run-to-run spread" not in result.summary_md.read_text()
    assert {m.run: (m.repeats, m.noise_basis) for m in result.shown} == {
        "s/dp1": (1, "step-time spread (no repeats)"), "s/dp2": (1, "step-time spread (no repeats)")}


def test_dp_efficiency_above_one_beyond_the_noise_is_flagged(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dp_run(tmp_path / "sup" / "dp1", [100.0])  # equal steps: no step-time spread, so no tolerance
    dp_run(tmp_path / "sup" / "dp2", [120.0, 120.0])  # 240 job tokens/s on 2 ranks: 120% efficient
    dp_run(tmp_path / "sup" / "dp4", [90.0] * 4)
    result = report(tmp_path, tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    assert by["sup/dp2"].flag.startswith("efficiency 120% over dp1 is above 100% (superlinear scaling), beyond the "
                                         "measured noise ±0.0%")
    assert not by["sup/dp4"].flag and not by["sup/dp1"].flag
    assert "warning: run sup/dp2: efficiency 120% over dp1" in capsys.readouterr().err
    summary = result.summary_md.read_text()
    assert table_row(summary, "dp=2")[10:12] == ["2.40× vs dp=1 ⚠", "120% ⚠"]
    assert "## Results that break a physical bound (⚠)" in summary and "| sup/dp2 | efficiency 120%" in summary
    with open(result.summary_csv, newline="") as f:
        flags = {row["run"]: row["flag"] for row in csv.DictReader(f)}
    assert flags["sup/dp2"].startswith("efficiency 120%") and flags["sup/dp4"] == ""


def test_an_efficiency_above_one_within_the_repeats_spread_is_not_flagged(tmp_path: Path) -> None:
    dp_run(tmp_path / "noisy" / "dp1-r0", [100.0], **{"launch.repeat": 0})
    dp_run(tmp_path / "noisy" / "dp1-r1", [125.0], **{"launch.repeat": 1})  # mean 112.5, spread 22%
    dp_run(tmp_path / "noisy" / "dp2", [115.0, 115.0])  # 230 / 225: 102% efficient, inside the spread
    result = report(tmp_path, tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    assert by["noisy/dp2"].efficiency == pytest.approx(230 / 225) and not by["noisy/dp2"].flag
    assert by["noisy/dp1-r0"].noise == pytest.approx(25 / 112.5)
    assert table_row(result.summary_md.read_text(), "dp=2")[11] == "102% (within noise)"


@pytest.mark.parametrize("rate, flagged", [(110.0, False), (140.0, True)])
def test_a_pipeline_at_one_chunk_faster_than_model_parallel_beyond_the_noise_is_flagged(
        tmp_path: Path, rate: float, flagged: bool) -> None:
    # Both runs' two kept steps take 1.1 and 0.9 times their mean: a step-time spread of sqrt(2) x 0.1 each, so
    # the tolerance is 28.3%: 1.10x is within it, 1.40x is not.
    pipe = {"devices": "cpu,cpu", "jitter": 0.1}
    dp_run(tmp_path / "pp" / "mp", [100.0], pp_mode="model_parallel", **pipe)
    dp_run(tmp_path / "pp" / "m1", [rate], pp_mode="pipeline_parallel", chunks=1, **pipe)
    dp_run(tmp_path / "pp" / "m4", [200.0], pp_mode="pipeline_parallel", chunks=4, **pipe)
    result = report(tmp_path, tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    m1 = by["pp/m1"]
    assert m1.speedup == pytest.approx(rate / 100) and m1.noise == pytest.approx(math.sqrt(2) * 0.1)
    assert bool(m1.flag) is flagged and not by["pp/m4"].flag  # only chunks=1 has a bound that must hold
    if flagged:
        assert m1.flag.startswith("pipeline at chunks=1 runs 1.40x as fast as model parallel mp on the same devices")
        assert "beyond the measured noise ±28.3%" in m1.flag
    summary = result.summary_md.read_text()
    mp = "pp_mode=model_parallel, chunks=4"
    assert table_row(summary, "pp_mode=pipeline_parallel, chunks=1")[10:12] == [
        f"{rate / 100:.2f}× vs {mp}" + (" ⚠" if flagged else ""), "–"]
    assert table_row(summary, mp)[10:12] == [f"1.00× vs {mp}", "–"]


def test_bleu_per_epoch_beside_the_losses(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "mt" / "a", [100.0], bleu=[12.5, 20.0], test_bleu=[11.0, 18.5])
    dp_run(tmp_path / "runs" / "mt" / "b", [100.0])  # no BLEU: nothing BLEU-related for it
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    by = {m.run: m for m in result.runs}
    assert by["mt/a"].epoch_points == [EpochPoint(1, 2, 2.0, 12.5, 11.0), EpochPoint(2, 4, 2.0, 20.0, 18.5)]
    assert (by["mt/a"].final_bleu, by["mt/a"].final_test_bleu) == (20.0, 18.5)
    assert by["mt/b"].final_bleu is None and by["mt/b"].final_test_bleu is None
    section = result.summary_md.read_text().split("## BLEU per epoch")[1].split("\n## ")[0]
    # Steps take 1 s; the loss of step s is 4 - 0.1 s.
    assert "| a | 1 | 2 | 2.0 | 3.800 | 2.000 | 12.50 | 11.00 |" in section
    assert "| a | 2 | 4 | 4.0 | 3.600 | 2.000 | 20.00 | 18.50 |" in section
    assert "| b |" not in section
    with open(result.summary_csv, newline="") as f:
        rows = {row["run"]: (row["final_bleu"], row["final_test_bleu"]) for row in csv.DictReader(f)}
    assert rows == {"mt/a": ("20", "18.5"), "mt/b": ("", "")}
    assert "bleu_mt.png" in {p.name for p in result.figures}


def test_runs_without_bleu_show_nothing_of_it(tmp_path: Path) -> None:
    dp_run(tmp_path / "runs" / "lm" / "a", [100.0])
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER)
    assert "BLEU" not in result.summary_md.read_text()
    assert not list((tmp_path / "out").glob("bleu_*"))
    assert any(s.startswith("figure bleu_*.png skipped") for s in result.skipped)


def stage_ranks(run_dir: Path, bleu: object) -> None:
    """A two-stage engine run whose first stage (no replica's loss) logs the epoch's BLEU, as rank 0 may."""
    ranks = [Rank(run_dir, r, config(**{"parallel.pp": 2}), coords={"pp": r, "dp": 0, "tp": 0},
                  sizes={"pp": 2, "dp": 1, "tp": 1}, stage_devices=["cpu"]).header() for r in range(2)]
    for rank in ranks:
        rank.step(1, 1, loss=None if rank.rank == 0 else 3.0)
    ranks[0].epoch(1, 1.0, 100.0, bleu=bleu).final(step=1)
    ranks[1].epoch(1, 1.0, 100.0).final(step=1)


def test_bleu_is_read_from_whichever_rank_logged_it(tmp_path: Path) -> None:
    stage_ranks(tmp_path / "e", 31.0)
    assert metrics(tmp_path, warmup_steps=0)["e"].epoch_points == [EpochPoint(1, 1, 2.0, 31.0)]


def test_a_bleu_that_is_not_a_number_is_left_out_with_a_warning(tmp_path: Path) -> None:
    stage_ranks(tmp_path / "e", "high")
    m = metrics(tmp_path, warmup_steps=0)["e"]
    assert m.final_bleu is None
    assert "e: epoch 1's bleu (rank 0) is not a number: 'high'; left out" in m.warnings


def loader_set(runs: Path) -> None:
    dp_run(runs / "s" / "dp1", [100.0])
    dp_run(runs / "s" / "dp2", [90.0, 90.0])


def test_the_loader_gives_the_run_table_as_plain_rows(tmp_path: Path) -> None:
    from analysis import load_runs

    loader_set(tmp_path)
    rows = {row["run"]: row for row in load_runs(tmp_path, frame=False)}
    dp2 = rows["s/dp2"]
    assert (dp2["job_tokens_per_s"], dp2["speedup"], dp2["efficiency"], dp2["baseline"]) == (
        pytest.approx(180.0), pytest.approx(1.8), pytest.approx(0.9), "dp1")
    assert (dp2["gpus"], dp2["parallel.dp"], dp2["parallel.dp_sync"], dp2["shown"]) == (2, 2, "bucketed", True)
    assert dp2["stitched_epochs"] == [] and dp2["bubble_flagged"] is False and dp2["mfu"] is None


def test_the_loader_gives_a_dataframe_where_pandas_is_installed(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    from analysis.load import load_runs

    loader_set(tmp_path)
    frame = load_runs(tmp_path)
    assert isinstance(frame, pandas.DataFrame) and len(frame) == 2
    assert frame.set_index("run").loc["s/dp2", "speedup"] == pytest.approx(1.8)


def test_the_loader_without_pandas_gives_rows_or_says_what_is_missing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from analysis.load import load_runs

    loader_set(tmp_path)
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
    assert [row["run"] for row in load_runs(tmp_path)] == ["s/dp1", "s/dp2"]
    with pytest.raises(GptparError, match=r"load_runs\(frame=True\) needs pandas"):
        load_runs(tmp_path, frame=True)
