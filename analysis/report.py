"""`gptpar report`: every run under a runs folder into summary.csv, summary.md and figures.

Runs are read and reduced one at a time (in worker processes when there are many), so only
their small metrics, never their raw records, are held together.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from analysis.aggregate import RunMetrics, apply_mfu, apply_sweep_records, run_metrics
from analysis.canvas import FigureSet
from analysis.figures import make_figures
from analysis.grouping import check_keys
from analysis.scaling import apply_speedups
from analysis.summary import markdown, write_csv
from analysis.target import apply_targets, check_target
from analysis.trace import analyse_run
from gptpar.atomic import write_error
from gptpar.errors import GptparError
from gptpar.paths import check_path
from gptpar.run.folder import RunFolder, find_runs, holds_run
from gptpar.run.plan_file import read_plan
from gptpar.run.state import LIVE_JOB_STATES, read_run
from gptpar.run.sweeps import SWEEP_RECORD

PARALLEL_FROM = 16  # below this many runs, worker start-up costs more than it saves


@dataclass
class ReportResult:
    runs: list[RunMetrics]  # every run listed (summary.csv), in path order
    shown: list[RunMetrics]  # the runs in the table and figures
    summary_csv: Path
    summary_md: Path
    figures: list[Path]  # the files written, each once
    skipped: list[str] = field(default_factory=list)  # figures not written and why, and matplotlib's warnings
    left_out: list[str] = field(default_factory=list)  # runs found but not listed (in progress, nested runs folders)


def _analyse(folder: RunFolder, runs_dir: Path, now: float, warmup_epochs: int, warmup_steps: int) -> RunMetrics:
    run = read_run(folder, runs_dir, now=now)
    metrics = run_metrics(run, folder.path.relative_to(runs_dir).as_posix(), warmup_epochs, warmup_steps)
    try:
        metrics.plan = read_plan(folder.path)
    except ValueError as exc:
        metrics.warnings.append(f"run {metrics.run}: {exc}")
    if folder.trace_dir.is_dir():
        try:
            metrics.traces, skipped = analyse_run(folder.path, top=0)
        except GptparError as exc:
            skipped = [str(exc)]
        metrics.warnings += [f"run {metrics.run}: trace {line}" for line in skipped]
    return metrics


def nested_runs(runs_dir: Path) -> dict[Path, int]:
    """Folders under runs_dir that are runs folders of their own (runs/demo, made by `--runs-dir runs/demo`): a
    folder whose sweep folders hold sweep records sits deeper than runs_dir's own sweeps, and its runs belong to
    its own report, not to the parent's table (folder -> its runs)."""
    roots = {root for record in runs_dir.rglob(SWEEP_RECORD)
             if (root := record.parent.parent) != runs_dir and root.is_relative_to(runs_dir)}
    roots = {root for root in roots if not any(root.is_relative_to(other) for other in roots - {root})}
    return {root: len(find_runs(root)) for root in sorted(roots)}


def _nested_note(nested: dict[Path, int]) -> str:
    """The runs folders nested in a report's, each with its runs and the command that reports it."""
    return "; ".join(f"{root} holds sweeps of its own ({n} run(s); `gptpar report {root}`)"
                     for root, n in nested.items())


def _own_runs(runs_dir: Path) -> list[RunFolder]:
    """The run folders under runs_dir that are not inside a runs folder of their own (nested_runs)."""
    nested = nested_runs(runs_dir)
    return [d for d in find_runs(runs_dir) if not any(d.path.is_relative_to(root) for root in nested)]


def analyse_runs(runs_dir: str | Path, warmup_epochs: int = 1, warmup_steps: int = 5,
                 now: float | None = None, workers: int | None = None, peak_flops: float | None = None
                 ) -> list[RunMetrics]:
    """Metrics of every run under runs_dir (runs outside a sweep folder in the sweep "top-level"; runs of a runs
    folder nested in it, such as runs/demo, left to their own report), or of the one run whose folder runs_dir is;
    peak_flops (FLOP/s per device) gives MFU a peak for devices the table lacks, such as a CPU."""
    runs_dir = check_path(runs_dir, "folder", "runs directory")
    dirs = _own_runs(runs_dir)
    if not dirs and holds_run(runs_dir):  # `gptpar report runs/tr1`: that run, named as in its runs folder
        dirs, runs_dir = [RunFolder(runs_dir)], runs_dir.parent
    if not dirs and (nested := nested_runs(runs_dir)):
        raise GptparError(f"no run folders of its own under {str(runs_dir)!r}: {_nested_note(nested)}")
    if not dirs:
        raise GptparError(f"no run folders (with config.yaml or rank*.jsonl files) under {str(runs_dir)!r}")
    work = partial(_analyse, runs_dir=runs_dir, now=time.time() if now is None else now,
                   warmup_epochs=warmup_epochs, warmup_steps=warmup_steps)
    if workers is None:
        workers = (os.cpu_count() or 1) if len(dirs) >= PARALLEL_FROM else 1
    if workers > 1:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            metrics = list(pool.map(work, dirs, chunksize=max(1, len(dirs) // (8 * workers))))
    else:
        metrics = [work(d) for d in dirs]
    apply_sweep_records(metrics, runs_dir)
    apply_mfu(metrics, peak_flops)
    return metrics


def run_table(runs_dir: str | Path = "runs", warmup_epochs: int = 1, warmup_steps: int = 5,
              include_incomplete: bool = False, now: float | None = None, workers: int | None = None,
              peak_flops: float | None = None, target_loss: float | None = None, group_by: Sequence[str] = ()
              ) -> tuple[list[RunMetrics], list[RunMetrics]]:
    """(every run, the runs shown in the table and figures) with times to the target loss (target_loss, else each
    sweep's), speedups (runs outside a sweep only under group_by), repeats and flags: what the report and the
    notebook loader (analysis.load) both start from."""
    check_target(target_loss)
    runs = analyse_runs(runs_dir, warmup_epochs, warmup_steps, now, workers, peak_flops)
    shown = [r for r in runs if not r.set_aside and not r.mixed and (r.status in ("completed", "diverged")
                                                                     or (include_incomplete and r.status != "corrupt"))]
    apply_targets(shown, target_loss)
    apply_speedups(shown, group_by)
    return runs, shown


def print_warnings(runs: list[RunMetrics]) -> None:
    """Every run's warnings, and the corrupt runs left out, on stderr."""
    for r in runs:
        for warning in r.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if r.status == "corrupt":
            print(f"warning: run {r.run} is corrupt and left out: {r.detail}", file=sys.stderr)


def _write(result: ReportResult, runs_dir: Path, warmup: str, figs: FigureSet) -> None:
    out = figs.out_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_csv(result.runs, result.summary_csv)
        result.summary_md.write_text(markdown(result.runs, result.shown, runs_dir, warmup, result.left_out),
                                     encoding="utf-8")
        result.figures = make_figures(result.shown, figs, say=result.skipped.append)
    except OSError as exc:  # a full disk, or a folder that vanished under the report
        raise write_error(exc.filename or out, exc) from None


def report(runs_dir: str | Path = "runs", out_dir: str | Path = "figures", warmup_epochs: int = 1,
           warmup_steps: int = 5, include_incomplete: bool = False, now: float | None = None,
           workers: int | None = None, peak_flops: float | None = None, group_by: Sequence[str] = (),
           x: str | None = None, fmt: str = "png", dpi: int = 110, target_loss: float | None = None,
           include_running: bool = False) -> ReportResult:
    """summary.csv, summary.md and the figures (as fmt at dpi; lines by the group_by keys, against x) of the runs
    under runs_dir, in out_dir; time to target_loss (else each sweep's report.target_loss or highest final loss).
    Runs still pending or running are left out, and counted, unless include_running (or include_incomplete, which
    also draws them) lists them: a report made while a sweep runs would otherwise mix finished and moving numbers."""
    out = check_path(out_dir, "folder", "--out", "name a folder for the report", must_exist=False)  # before any run
    figs = FigureSet(out, fmt, dpi, x, tuple(group_by))
    runs, shown = run_table(runs_dir, warmup_epochs, warmup_steps, include_incomplete, now, workers, peak_flops,
                            target_loss, group_by)
    check_keys(runs, "--group-by", group_by)
    check_keys(runs, "--x", [x] if x else [])
    print_warnings(runs)
    warmup = (f"the first {warmup_epochs} epoch(s) of runs with more epochs than that, "
              f"else the first {warmup_steps} step(s)")
    live = [] if include_running or include_incomplete else [r for r in runs if r.status in LIVE_JOB_STATES]
    listed = [r for r in runs if r not in live]
    left_out = [f"{len(live)} run(s) still in progress ({', '.join(r.run for r in live)}); `--include-running` "
                "lists them"] if live else []
    if nested := nested_runs(Path(runs_dir)):
        left_out.append(_nested_note(nested))
    result = ReportResult(listed, shown, out / "summary.csv", out / "summary.md", [], left_out=left_out)
    _write(result, Path(runs_dir), warmup, figs)
    return result
