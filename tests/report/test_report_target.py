"""Time and tokens to a target loss on synthetic logs whose answers are worked by hand, "not reached", and the
summary's one row per sweep point named by the keys its sweep varies."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from logsets import T0, Rank, config

from analysis.report import report
from gptpar.cli import main as gptpar_main
from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder

LATER = T0 + 3600.0


def run(path: Path, dp: int, losses: list[float], step_s: float, val: dict[int, float] | None = None,
        **cfg: object) -> None:
    """dp ranks, step i (from 1) with global loss losses[i-1], taking step_s s on every rank and 100 tokens each;
    val: eval records (step -> validation loss)."""
    ranks = [Rank(path, r, config(name=path.name, dp=dp, **cfg)).header() for r in range(dp)]
    for i, loss in enumerate(losses, 1):
        for rank in ranks:
            rank.step(i, 1, step_time_s=step_s, loss=loss, global_loss=loss)
            if val and i in val:
                rank.eval(i, val[i])
    for rank in ranks:
        rank.epoch(1, step_s * len(losses), 100 / step_s, steps=len(losses), val_loss=None).final(step=len(losses))


def cells(line: str) -> list[str]:
    """A markdown table row's cells."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def demo_like(root: Path) -> None:
    """The demo's shape: 2 ranks give twice the tokens/s (steps of 1 s either way) but, at twice the global batch,
    lose less per step: dp=1 reaches 5.45 at step 3 (3 s, 300 tokens), dp=2 at step 4 (4 s, 800 tokens), twice."""
    for i in (0, 1):
        run(root / "s" / f"dp1-r{i}", 1, [6.0, 5.6, 5.4, 5.3, 5.2, 5.1], 1.0, **{"launch.repeat": i,
                                                                              "train.batch_size": 16})
        run(root / "s" / f"dp2-r{i}", 2, [6.0, 5.7, 5.5, 5.45], 1.0, **{"launch.repeat": i, "train.batch_size": 32})


def csv_rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def test_time_and_tokens_to_the_default_target_and_the_disagreement_said(tmp_path: Path) -> None:
    demo_like(tmp_path / "runs")
    RunFolder(tmp_path / "runs" / "s" / "dp1-r0").write_job_record("local", "vm:4242.1", "dp")
    result = report(tmp_path / "runs", tmp_path / "out", now=LATER, warmup_steps=1)
    rows = csv_rows(result.summary_csv)
    assert (rows["s/dp1-r0"]["job_id"], rows["s/dp1-r1"]["job_id"]) == ("vm:4242.1", "")  # the job that ran it
    # The default target is the highest final loss of the sweep: dp=2's 5.45, which every run reaches.
    assert {row["target_loss"] for row in rows.values()} == {"5.45"}
    assert (rows["s/dp1-r0"]["time_to_target_s"], rows["s/dp1-r0"]["tokens_to_target"]) == ("3", "300")
    assert (rows["s/dp2-r1"]["time_to_target_s"], rows["s/dp2-r1"]["tokens_to_target"]) == ("4", "800")
    assert rows["s/dp2-r0"]["target_basis"] == "train" and rows["s/dp2-r0"]["time_to_target_speedup"] == "0.75"
    summary = result.summary_md.read_text()
    main = [line for line in summary.split("\n## ")[0].splitlines() if line.startswith("| s | ")]
    assert [line.split(" | ")[1:3] for line in main] == [["dp=1, batch_size=16", "2"], ["dp=2, batch_size=32", "2"]]
    dp2 = main[1].split(" | ")
    assert dp2[10:15] == ["2.00× vs mean of 2 repeats of dp=1, batch_size=16", "100%", "4.0", "5.450 (train)", "0.75×"]
    assert ("- dp=2, batch_size=32: 2.00× the job tokens/s of mean of 2 repeats of dp=1, batch_size=16, but it "
            "reaches the target train loss 5.45 later: after 4.0 s of training against 3.0 s") in summary


def test_a_given_target_uses_validation_loss_and_one_never_reached_says_so(tmp_path: Path) -> None:
    # a evaluates: validation 5.0 at step 2 and 4.0 at step 4, while its train loss crosses 4.5 at step 1.
    run(tmp_path / "s" / "a", 1, [4.4, 4.3, 4.2, 4.1], 2.0, val={2: 5.0, 4: 4.0})
    run(tmp_path / "s" / "b", 2, [6.0, 5.0, 4.9], 1.0)  # never at or below 4.5
    result = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0, target_loss=4.5)
    rows = csv_rows(result.summary_csv)
    assert (rows["s/a"]["target_basis"], rows["s/a"]["time_to_target_s"], rows["s/a"]["tokens_to_target"]) == (
        "validation", "8", "400")
    assert (rows["s/b"]["time_to_target_s"], rows["s/b"]["tokens_to_target"], rows["s/b"]["target_loss"]) == (
        "", "", "4.5")
    summary = result.summary_md.read_text()
    b = next(line for line in summary.splitlines() if line.startswith("| s | dp=2 |")).split(" | ")
    assert b[12:15] == ["not reached", "4.900 (train)", "not reached"]
    assert "- s: 4.5 (--target-loss)" in summary
    assert "dp=2: 1.00× the job tokens/s of dp=1, yet it never reaches" not in summary  # no faster: no claim


def test_the_sweeps_report_target_loss_is_its_target(tmp_path: Path) -> None:
    for name, dp in (("a", 1), ("b", 2)):
        run(tmp_path / "s" / name, dp, [6.0, 5.0, 4.0], 1.0, **{"report.target_loss": 5.0})
    rows = csv_rows(report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0).summary_csv)
    assert {(row["target_loss"], row["time_to_target_s"]) for row in rows.values()} == {("5", "2")}


def test_runs_that_disagree_on_report_target_loss_are_timed_to_the_highest(tmp_path: Path) -> None:
    """a asks 5.0, b asks 4.5, c asks none: every run is timed to 5.0 (step 2, 2 s, 200 tokens a rank), the target
    that every run's own ask is at or below; the lowest (4.5) would take step 3."""
    for name, dp, target in (("a", 1, 5.0), ("b", 2, 4.5), ("c", 1, None)):
        asked = {"report.target_loss": target} if target is not None else {}
        run(tmp_path / "s" / name, dp, [6.0, 5.0, 4.0], 1.0, **asked)
    result = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0)
    rows = csv_rows(result.summary_csv)
    assert {name: (row["target_loss"], row["time_to_target_s"], row["tokens_to_target"])
            for name, row in rows.items()} == {"s/a": ("5", "2", "200"), "s/b": ("5", "2", "400"),
                                               "s/c": ("5", "2", "200")}
    assert "- s: 5 (report.target_loss)" in result.summary_md.read_text()


@pytest.mark.parametrize("value", ["-1", "abc", "0"])
def test_a_bad_target_loss_is_one_line(tmp_path: Path, value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        gptpar_main(["report", str(tmp_path), "--target-loss", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--target-loss" in err and "positive finite number" in err
    with pytest.raises(GptparError, match="target loss is a finite number above 0"):
        report(tmp_path, tmp_path / "out", target_loss=float("nan"))


def test_the_loss_the_target_is_checked_on_stands_beside_it_and_the_fastest_layout_is_named(tmp_path: Path) -> None:
    # b's train loss ends at 4.3, below the target 4.5, but its validation loss, which the target is checked on,
    # ends at 4.8: "not reached" must stand beside 4.8, not only beside the lower train loss.
    run(tmp_path / "s" / "a", 1, [4.4, 4.3, 4.2, 4.1], 2.0, val={2: 5.0, 4: 4.0})  # reached at step 4: 8 s
    run(tmp_path / "s" / "b", 2, [6.0, 4.4, 4.3], 1.0, val={3: 4.8}, **{"train.lr": 0.001})
    run(tmp_path / "s" / "c", 2, [5.0, 4.4], 1.0, val={1: 4.6, 2: 4.2}, **{"train.lr": 0.002})  # 2 s, 400 tokens
    summary = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0, target_loss=4.5).summary_md.read_text()
    header = cells(next(line for line in summary.splitlines() if line.startswith("| sweep |")))
    rows = {row["point"]: row for line in summary.split("\n## ")[0].splitlines() if line.startswith("| s | ")
            and (row := dict(zip(header, cells(line), strict=True)))}
    checked = "final loss checked against the target"
    shown = {name: (row["time to target (s)"], row[checked], row["final loss (train)"]) for name, row in rows.items()}
    assert shown == {
        "dp=1, lr=0.0006": ("8.0", "4.000 (validation)", "4.100"),
        "dp=2, lr=0.001": ("not reached", "4.800 (validation)", "4.300"),
        "dp=2, lr=0.002": ("2.0", "4.200 (validation)", "4.400")}
    assert ("- s: 4.5 (--target-loss). Fastest to the target in s: dp=2, lr=0.002 (2 ranks, dp=2), after 2.0 s of "
            "training and 400 tokens.") in summary
