"""A classifier's accuracy in the report (issue 49): its columns in summary.md and summary.csv, time to a target
accuracy, the methods-side-by-side figure, the line a run ends with, and sweeps/vit.yaml's course table, on logs
whose answers are worked by hand."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml
from conftest import REPO
from logsets import T0, classify_run
from matplotlib.figure import Figure

from analysis.report import report
from gptpar.launch.status import completion
from gptpar.launch.sweep import expand
from gptpar.run.folder import RunFolder

LATER = T0 + 3600.0


def course_set(root: Path, **asks: dict[str, object]) -> None:
    """Sweep s: a (one rank, steps of 0.5 s) ends at 60% top-1 and 90% top-5; b (two ranks, steps of 1 s) reaches
    50% at step 2 and ends at 55%, 85%; c is a language run of two ranks (steps of 1 s): no accuracy. asks: a run's
    extra config."""
    classify_run(root / "s" / "a", 1, 0.5, {2: (0.30, 0.70), 4: (0.60, 0.90)}, peaks=(2_000_000_000,),
                 **{"data.task": "classify", **asks.get("a", {})})
    classify_run(root / "s" / "b", 2, 1.0, {2: (0.50, 0.80), 4: (0.55, 0.85)}, peaks=(1_000_000_000, 1_500_000_000),
                 **{"data.task": "classify", **asks.get("b", {})})
    classify_run(root / "s" / "c", 2, 1.0, {}, peaks=(500_000_000, 500_000_000))


def csv_rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def table(summary: str) -> dict[str, dict[str, str]]:
    """summary.md's main table, point -> column -> cell."""
    lines = [line for line in summary.split("\n## ")[0].splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("| \n").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("| \n").split("|")), strict=True))
            for line in lines[1:]]
    return {row["point"]: row for row in rows}


def test_accuracy_columns_and_the_time_to_the_default_target_accuracy(tmp_path: Path) -> None:
    """The default target is the lowest final accuracy, b's 55%: a reaches it at step 4 (2 s, 400 tokens), b at step
    4 (4 s, 800 tokens over its two replicas); c logs none, so its cells are –, never 0 or "not reached"."""
    course_set(tmp_path)
    result = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0)
    rows = csv_rows(result.summary_csv)
    columns = ("final_accuracy", "final_accuracy_top5", "target_accuracy", "time_to_accuracy_s", "tokens_to_accuracy")
    assert {run: tuple(row[c] for c in columns) for run, row in rows.items()} == {
        "s/a": ("0.6", "0.9", "0.55", "2", "400"), "s/b": ("0.55", "0.85", "0.55", "4", "800"),
        "s/c": ("", "", "", "", "")}
    summary = result.summary_md.read_text()
    cells = {point: (row["job tokens/s"], row["accuracy (top-1)"], row["accuracy (top-5)"],
                     row["time to target accuracy (s)"]) for point, row in table(summary).items()}
    assert cells == {"dp=1, task=classify": ("200", "60.0%", "90.0%", "2.0"),
                     "dp=2, task=classify": ("200", "55.0%", "85.0%", "4.0"),
                     "dp=2, task=lm": ("200", "–", "–", "–")}
    assert ("- s: 55.0% top-1 (the lowest final accuracy of the sweep's runs). Fastest to the target in s: dp=1, "
            "task=classify (1 rank, dp=1), after 2.0 s of training and 400 tokens.") in summary
    language = report(tmp_path / "s" / "c", tmp_path / "lm", now=LATER, warmup_steps=0).summary_md.read_text()
    assert "accuracy (top-1)" not in table(language).popitem()[1]  # language runs alone: no accuracy columns


def test_runs_that_ask_different_target_accuracies_are_timed_to_the_lowest(tmp_path: Path) -> None:
    """a asks 52%, b 50%: both are timed to 50%, the target each run's own ask is at least as hard as; b's 50% at
    step 2 reaches it (at or above), 2 s and 400 tokens; a, at 30% there, reaches it at step 4, 2 s."""
    course_set(tmp_path, a={"report.target_accuracy": 0.52}, b={"report.target_accuracy": 0.5})
    result = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0)
    rows = csv_rows(result.summary_csv)
    assert {run: (row["target_accuracy"], row["time_to_accuracy_s"], row["tokens_to_accuracy"])
            for run, row in rows.items()} == {"s/a": ("0.5", "2", "400"), "s/b": ("0.5", "2", "400"),
                                              "s/c": ("", "", "")}
    assert "- s: 50.0% top-1 (report.target_accuracy)." in result.summary_md.read_text()


def test_a_target_accuracy_no_run_reaches_says_so(tmp_path: Path) -> None:
    course_set(tmp_path, a={"report.target_accuracy": 0.95}, b={"report.target_accuracy": 0.95})
    summary = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0).summary_md.read_text()
    assert [row["time to target accuracy (s)"] for row in table(summary).values()] == ["not reached", "not reached",
                                                                                      "–"]
    assert "- s: 95.0% top-1 (report.target_accuracy). No point of s reaches its target." in summary


def bars(ax) -> list[tuple[float, float]]:  # noqa: ANN001 - a matplotlib Axes
    """(row, length) of an axes' horizontal bars, from the first row (the sweep's first point) down."""
    return sorted((round(p.get_y() + p.get_height() / 2, 6), round(p.get_width(), 6)) for p in ax.patches)


def test_the_line_a_run_ends_with_shows_its_last_accuracy(tmp_path: Path) -> None:
    """What `gptpar train` prints last: the latest evaluation's top-1 and top-5 beside the validation loss."""
    classify_run(tmp_path / "a", 1, 0.5, {2: (0.30, 0.70), 4: (0.60, 0.90)}, **{"data.task": "classify"})
    state, line = completion(RunFolder(tmp_path / "a"))
    assert state == "completed" and ", val_loss 2.0000, accuracy 0.60, accuracy_top5 0.90, " in line, line


def test_the_comparison_draws_memory_throughput_epoch_time_and_accuracy_side_by_side(
        tmp_path: Path, drawn: dict[str, Figure]) -> None:
    """Peak memory is the fullest rank's (a 2 GB, b 1.5 GB, c 0.5 GB), throughput the job's tokens/s (200 each),
    epoch time the epoch record's (2, 4, 4 s), accuracy the final top-1 beside the top-5 (hatched): c, a
    language run, has none, so a – stands at its place in that panel and no bar."""
    course_set(tmp_path)
    report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0)
    memory, rate, time, accuracy = drawn["comparison_s.png"].axes
    assert bars(memory) == [(0, 2.0), (1, 1.5), (2, 0.5)]
    assert bars(rate) == [(0, 200.0), (1, 200.0), (2, 200.0)]
    assert bars(time) == [(0, 2.0), (1, 4.0), (2, 4.0)]
    assert bars(accuracy) == [(-0.2, 0.6), (0.2, 0.9), (0.8, 0.55), (1.2, 0.85)]  # top-1 left, top-5 right
    assert [(t.get_text(), t.get_position()) for t in accuracy.texts] == [(" –", (0, 1.8)), (" –", (0, 2.2))]
    assert [t.get_text() for t in memory.get_yticklabels()] == ["dp=1, task=classify", "dp=2, task=classify",
                                                               "dp=2, task=lm"]
    assert [ax.get_title() for ax in (memory, rate, time, accuracy)] == ["Peak memory, fullest rank", "Throughput",
                                                                         "Epoch time", "Accuracy, final"]


def test_a_sweep_without_accuracy_draws_no_comparison(tmp_path: Path, drawn: dict[str, Figure]) -> None:
    for name in ("a", "b"):
        classify_run(tmp_path / "s" / name, 2 if name == "b" else 1, 1.0, {})
    result = report(tmp_path, tmp_path / "out", now=LATER, warmup_steps=0)
    assert not [name for name in drawn if name.startswith("comparison")]
    assert ("figure comparison_*.png skipped: no sweep of two or more points logs accuracy (data.task=classify)"
            in result.skipped)


def test_the_vit_sweep_is_the_course_table_cpu_sized() -> None:
    """sweeps/vit.yaml runs LoRA (with activation checkpointing) on one device, then ddp, ZeRO-2, ZeRO-3 (fsdp and
    fsdp2) and ZeRO++ (fsdp with int8 gradients and parameters and hpZ) on two ranks, vit-tiny on the embedded set."""
    path = REPO / "sweeps" / "vit.yaml"
    name, kind, points = expand(path)
    keys = ("launch.gpus", "parallel.dp_sync", "train.lora_rank", "train.activation_checkpointing",
            "parallel.grad_comm", "parallel.param_comm", "parallel.hpz")
    table = [tuple(dict(pair.split("=", 1) for pair in pairs)[key] for key in keys) for _, pairs in points]
    assert (name, kind) == ("vit", "dp") and table == [
        ("1", "bucketed", "8", "block", "fp32", "fp32", "False"),  # LoRA on one device
        ("2", "ddp", "0", "none", "fp32", "fp32", "False"),
        ("2", "zero2", "0", "none", "fp32", "fp32", "False"),
        ("2", "fsdp", "0", "none", "fp32", "fp32", "False"),  # ZeRO-3
        ("2", "fsdp2", "0", "none", "fp32", "fp32", "False"),  # ZeRO-3, torch's
        ("2", "fsdp", "0", "none", "int8", "int8", "True")]  # ZeRO++: qgZ, qwZ, hpZ
    base = yaml.safe_load(path.read_text())["base"]
    assert (base["model"]["preset"], base["data"], base["launch"]["profile"]) == (
        "vit-tiny", {"task": "classify", "source": "synthetic"}, "local")
    assert base["train"]["max_steps"] <= 50  # a few dozen CPU steps
