"""The report's figures: scaling (time, throughput, speedup and efficiency against the GPU count or --x), pipeline
against model parallelism, loss against steps, tokens and time, BLEU, each swept key, pipeline timelines and
bubbles, memory, and a classifier sweep's methods side by side (peak memory, throughput, epoch time, accuracy).

A figure without data is skipped with a message: an empty plot in a report reads as a result. A result flagged for
breaking a physical bound (analysis.scaling) is left out of the speedup plots and ringed where its throughput is
drawn. A warning matplotlib raises while drawing becomes one line of the report's messages, never a Python warning.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import cycle
from pathlib import Path
from textwrap import fill
from typing import Any

from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator, PercentFormatter
from matplotlib.transforms import blended_transform_factory

from analysis.aggregate import (
    PIPELINE_OVERHEAD,
    TOP_LEVEL,
    MemoryUse,
    RunMetrics,
    key_value,
    pipeline_shortfall,
    sweep_axes,
)
from analysis.canvas import (
    FORMATS,
    NAME_MAX,
    OFF_COLOUR,
    OFF_MARK,
    REFERENCE,
    STYLE,
    FigureSet,
    bar_x,
    categorical,
    draw_bars,
    draw_marks,
    error_note,
    figure_size,
    footnote,
    legend,
    plt,
    stem,
    write,
    x_label,
    x_name,
    x_positions,
)
from analysis.grouping import (
    GRAD_COMM,
    Mark,
    Spread,
    category_order,
    compared,
    fp32_ratios,
    marks,
    point_keys,
    point_name,
    run_labels,
    run_names,
    series,
)
from analysis.scaling import Point, repeat_points
from analysis.summary import named_points
from gptpar.run.names import slug
from gptpar.strategies.data_parallel import DP_STRATEGIES, STATE_BYTES
from gptpar.strategies.pipeline import COMPUTE, Timeline, closed_form_bubble, schedule, simulate

CHUNKS = "parallel.chunks"
JOB_RATE = "job tokens/s (all replicas' / slowest rank's time)"
ONE_RUN_STD = "± sample std over its kept epochs (or steps)"
TEST_SCORES = {"bleu": "test_bleu"}  # an epoch score and its test split's twin, drawn dashed beside it


def _job(r: RunMetrics) -> Spread:
    return r.job_tokens_per_s, r.job_tokens_std


def _epoch_time(r: RunMetrics) -> Spread:
    return r.epoch_time


def _scaling_runs(runs: list[RunMetrics], figs: FigureSet) -> tuple[list[RunMetrics], str]:
    """The runs of the scaling figures and their x: every compared run (a sweep's, or any under --group-by) against
    --x, else the compared single-mode (data- and tensor-parallel) runs against the GPU count; pipelines have their
    own figure, against micro-batches."""
    runs = [r for r in runs if compared(r, figs.group_by)]
    if figs.x:
        return runs, figs.x
    return [r for r in runs if r.pp_mode == "single"], "gpus"


def _scaling(runs: list[RunMetrics], figs: FigureSet, metric: str) -> bool:
    """Training time per epoch (metric "time") or job tokens/s ("tokens") against x, from 0, one line per series;
    against the GPU count each throughput line has its ideal, linear from its first point, dashed."""
    data, x = _scaling_runs(runs, figs)
    value = _epoch_time if metric == "time" else _job
    data = [r for r in data if value(r)[0] is not None]
    if not data:
        return False
    fig, ax = plt.subplots()
    at = x_positions(ax, [key_value(r, x) for r in data])
    shown: list[Mark] = []
    for label, members in series(data, x, figs.group_by).items():
        points = marks(members, x, value)
        draw_marks(ax, points, at, ring=True, label=label)
        shown += points
        if metric == "tokens" and x == "gpus":
            first = points[0]
            ax.plot([at(m.x) for m in points], [first.y * m.x / first.x for m in points], **REFERENCE,
                    label="ideal: linear from a line's first point")
    ax.set_ylim(bottom=0)
    ax.set_xlabel(x_label(data, x))
    along = x_name(data, x)
    if metric == "time":
        ax.set_ylabel("training time per epoch (s)")
        ax.set_title(f"Training time vs {along}", fontsize=9)
    else:
        ax.set_ylabel(JOB_RATE)
        ideal = " (grey dashed: ideal)" if x == "gpus" else ""
        ax.set_title(f"Throughput vs {along}{ideal}", fontsize=9)
    footnote(fig, error_note(shown, ONE_RUN_STD))
    legend(fig)
    figs.save(fig, stem("time_vs" if metric == "time" else "throughput_vs", x.rpartition(".")[2]), x)
    return True


def _speedup(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """Speedup over each run's baseline (job tokens/s) and efficiency against x, their ideals dashed; flagged
    results are named on the figure and not plotted."""
    data, x = _scaling_runs(runs, figs)
    data = [r for r in data if r.speedup is not None]
    flagged = sorted({r.run_id for r in data if r.flag})
    kept = [r for r in data if not r.flag]
    if all(r.ideal_speedup in (None, 1.0) for r in kept):  # only baselines, each 1.00x by definition
        return False
    fig, (speed_ax, eff_ax) = plt.subplots(1, 2, figsize=(12, 4.4))
    at_speed = x_positions(speed_ax, [key_value(r, x) for r in kept])
    at_eff = x_positions(eff_ax, [key_value(r, x) for r in kept])
    shown: list[Mark] = []
    ratio = _device_ratio(kept)
    top = 1.1  # the efficiency axis shows 0 to at least 110%
    for label, members in series(kept, x, figs.group_by).items():
        points = marks(members, x, lambda r: (r.speedup, None))
        colour = draw_marks(speed_ax, points, at_speed, label=label)
        shown += points
        to_target = marks(members, x, lambda r: (r.target_speedup, None))
        if to_target:
            draw_marks(speed_ax, to_target, at_speed, color=colour, marker="s", markerfacecolor="white",
                       linestyle=":", label="time to target (squares, dotted)")
        ideal = marks(members, x, lambda r: (r.ideal_speedup, None))
        speed_ax.plot([at_speed(m.x) for m in ideal], [m.y for m in ideal], **REFERENCE, label=f"ideal: {ratio}")
        efficiency = marks(members, x, lambda r: (r.efficiency, None))
        if efficiency:
            draw_marks(eff_ax, efficiency, at_eff, color=colour)
            top = max(top, *(1.05 * m.high for m in efficiency))
    eff_ax.axhline(1.0, **REFERENCE, label="ideal: 100%")
    speed_ax.set_ylim(bottom=0)
    eff_ax.set_ylim(0, top)
    eff_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    for ax in (speed_ax, eff_ax):
        ax.set_xlabel(x_label(kept, x))
    speed_ax.set_ylabel("speedup over the sweep's baseline")
    speed_ax.set_title("Speedup (circles: job tokens/s, squares: time to target)", fontsize=9)
    eff_ax.set_ylabel(f"efficiency (speedup / {ratio})")
    eff_ax.set_title("Efficiency (grey dashed: 100%)", fontsize=9)
    fig.suptitle(f"Speedup and efficiency vs {x_name(kept, x)}", fontsize=9)
    footnote(fig, error_note(shown, "none (one run)"), _left_out(flagged))
    legend(fig)
    figs.save(fig, stem("speedup_vs", x.rpartition(".")[2]), x)
    return True


def _device_ratio(runs: list[RunMetrics]) -> str:
    """What a speedup's ideal is the ratio of (analysis.scaling): GPUs, or ranks where the runs ran on CPUs."""
    return {"GPUs": "GPU ratio", "ranks": "rank ratio"}.get(x_name(runs, "gpus"), "device ratio")


def _shortfall(runs: list[RunMetrics]) -> str:
    """Why pipelines fall short of their closed form, where some do (aggregate.pipeline_shortfall): a footnote."""
    short = [r.run_id for r in runs if pipeline_shortfall(r)]
    return f"Short of the closed form ({', '.join(short)}): {PIPELINE_OVERHEAD}." if short else ""


def _left_out(flagged: list[str]) -> str:
    """The footnote naming results flagged for breaking a physical bound, which a figure leaves out."""
    return f"{OFF_MARK} flagged, not plotted: {', '.join(flagged)} (see summary.md)" if flagged else ""


def _model_parallel(panels: tuple[tuple[plt.Axes, Callable[[RunMetrics], Spread]], ...], models: list[RunMetrics],
                    colour: str | None, name: str) -> None:
    """Model-parallel runs as dashed horizontal lines in each panel, one per sweep point at the mean of its repeats."""
    for point in repeat_points(models):
        for ax, value in panels:
            values = [v for r in point.runs if (v := value(r)[0]) is not None]
            if values:
                ax.axhline(statistics.fmean(values), linestyle="--", color=colour, label=f"model parallel {name}")


def _bubble_forms(speed_ax: plt.Axes, bubble_ax: plt.Axes, forms: set[tuple[int, int, int]]) -> None:
    """The one-process pipeline's bound on its speedup, p*m/(m+p-1), and its bubble's closed form, (p-1)/(m+p-1),
    in the reference style, once per stage count p and range of m (series that share them share the lines); the
    stage count is named where the lines differ in it."""
    named = len({p for p, *_ in forms}) > 1
    for p, first, last in sorted(forms):
        ms = list(range(first, last + 1))
        bubbles = [closed_form_bubble("gpipe", p, m) for m in ms]
        which = f", p={p}" if named else ""
        speed_ax.plot(ms, [p * (1.0 - b) for b in bubbles], **REFERENCE, label=f"bound: p·m/(m+p-1){which}")
        bubble_ax.plot(ms, bubbles, **REFERENCE, label=f"closed form: (p-1)/(m+p-1){which}")


def _pipeline(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """One-process pipelines against micro-batches: time and job tokens/s (model parallel on the same devices as a
    dashed line), speedup over model parallel with its bound p*m/(m+p-1), and the bubble with its closed form."""
    pipes = [r for r in runs if r.pp_mode == "pipeline_parallel"]
    models = [r for r in runs if r.pp_mode == "model_parallel"]
    if not pipes and not models:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    time_ax, rate_ax, speed_ax, bubble_ax = axes.flat
    panels = ((time_ax, _epoch_time), (rate_ax, _job))
    several = len({(r.devices, r.dp) for r in pipes}) > 1
    shown: list[Mark] = []
    drawn: set[tuple[str, int, int]] = set()  # (sweep, devices, dp) of the model-parallel lines drawn
    forms: set[tuple[int, int, int]] = set()  # (p, first m, last m) of the bound and closed form, each drawn once
    for label, members in series(pipes, CHUNKS, figs.group_by).items():
        for p, dp in sorted({(r.devices, r.dp) for r in members}):
            name = (f"{label} p={p}" if several else label) + (f" dp={dp}" if dp > 1 else "")
            line = [r for r in members if (r.devices, r.dp) == (p, dp)]
            colour = None
            for ax, value in panels:
                points = marks(line, CHUNKS, value)
                if points:
                    colour = draw_marks(ax, points, float, ring=True, label=f"pipeline {name}", color=colour)
                    shown += points
            speedups = marks([r for r in line if not r.flag], CHUNKS, lambda r: (r.speedup, None))
            if speedups:
                colour = draw_marks(speed_ax, speedups, float, color=colour)
            forms.add((p, min(r.chunks for r in line), max(r.chunks for r in line)))
            measured = marks([r for r in line if not r.bubble_flagged], CHUNKS,
                             lambda r: (r.bubble_measured, r.bubble_std))
            if measured:
                draw_marks(bubble_ax, measured, float, color=colour, linestyle="none")
            sweeps = {r.sweep for r in line}
            mine = [m for m in models if m.sweep in sweeps and (m.devices, m.dp) == (p, dp)
                    and (m.sweep, p, dp) not in drawn]
            _model_parallel(panels, mine, colour, name)
            drawn.update((m.sweep, p, dp) for m in mine)
    for sweep, p, dp in sorted({(m.sweep, m.devices, m.dp) for m in models} - drawn):
        _model_parallel(panels, [m for m in models if (m.sweep, m.devices, m.dp) == (sweep, p, dp)], "black",
                        f"{sweep} p={p}" + (f" dp={dp}" if dp > 1 else ""))
    _bubble_forms(speed_ax, bubble_ax, forms)
    flagged = sorted({r.run_id for r in pipes if r.flag})
    speed_ax.axhline(1.0, linestyle=":", color="black", label="model parallel: the speedup baseline, 1.00x")
    for ax, ylabel in ((time_ax, "training time per epoch (s)"), (rate_ax, JOB_RATE.replace(" (", "\n(")),
                       (speed_ax, "speedup over model parallel (job tokens/s)"),
                       (bubble_ax, "bubble (idle share of step time)")):
        ax.set_ylabel(ylabel)
        ax.set_xlabel("micro-batches per batch (chunks m)")
        ax.set_xticks(sorted({r.chunks for r in pipes}) or [1])
        ax.set_ylim(bottom=0)
    bubble_ax.set_ylim(0, 1)
    speed_ax.set_title("Speedup over model parallel (dashed: bound)", fontsize=9)
    bubble_ax.set_title("Bubble: measured (markers), closed form (grey dashed)", fontsize=9)
    fig.suptitle("Model parallel (dashed horizontal lines) vs pipeline parallel", fontsize=10)
    footnote(fig, error_note(shown, ONE_RUN_STD), _left_out(flagged), _shortfall(pipes))
    legend(fig)
    figs.save(fig, "pipeline_vs_model_parallel")
    return True


def identical_curves(runs: list[RunMetrics]) -> list[list[RunMetrics]]:
    """Runs grouped by their loss curves, bit for bit (train and validation losses at the same steps and tokens):
    repeats of a deterministic run coincide, and one line drawn over another would hide how many there are."""
    groups: dict[tuple, list[RunMetrics]] = {}
    for r in runs:
        tokens = tuple(r.progress[s][0] for s, _ in r.loss_curve if s in r.progress)
        groups.setdefault((tuple(r.loss_curve), tuple(r.val_curve), tokens), []).append(r)
    return list(groups.values())


def _losses(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """One figure per sweep: each run's training loss against optimizer steps, tokens seen and training time (did
    scaling help: the same loss sooner?), its validation points as squares. Runs whose losses are identical are one
    line, its label saying how many coincide; against time each keeps its own line (their times differ)."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if r.loss_curve:
            by_sweep.setdefault(r.sweep, []).append(r)
    for sweep, members in sorted(by_sweep.items()):
        fig, axes = plt.subplots(1, 3, sharey=True, figsize=(13, 4.4))
        groups = identical_curves(members)
        firsts = [group[0] for group in groups]
        labels = run_names(firsts) if sweep == TOP_LEVEL else run_labels(firsts)  # ad-hoc runs: by their ids
        for group in groups:
            first, colour = group[0], None
            label = labels[first.run] + (f" ({len(group)} runs: identical losses)" if len(group) > 1 else "")
            for ax, unit in zip(axes, (None, 0, 1), strict=True):  # x: the step, or its tokens or seconds
                for r in group if unit == 1 else group[:1]:
                    train, val = ([(s if unit is None else r.progress[s][unit], v) for s, v in curve
                                   if s in r.progress] for curve in (r.loss_curve, r.val_curve))
                    colour = ax.plot(*zip(*train, strict=True), linewidth=1, color=colour,
                                     label=label)[0].get_color()
                    if val:
                        ax.plot(*zip(*val, strict=True), marker="s", linestyle="none", color=colour)
        axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[1].xaxis.set_major_formatter(EngFormatter())
        for ax, xlabel in zip(axes, ("optimizer step", "tokens seen (all replicas)",
                                     "training time (s: the slowest rank's steps)"), strict=True):
            ax.set_xlabel(xlabel)
        axes[0].set_ylabel("loss (nats/token; squares: validation)")
        fig.suptitle(f"Loss curves: {sweep}", fontsize=10)
        legend(fig)
        figs.save(fig, stem("loss", sweep), sweep)
    return bool(by_sweep)


def _scores(runs: list[RunMetrics], figs: FigureSet, key: str, label: str) -> bool:
    """One figure per sweep whose runs logged the epoch score `key` (bleu, answer_accuracy): validation loss and the
    score per epoch side by side, and the score against training time, one line per run that has it, named by the
    run (its config may differ in nothing but data files); a score's test-split twin (test BLEU) dashed beside it."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if any(getattr(p, key) is not None for p in r.epoch_points):
            by_sweep.setdefault(r.sweep, []).append(r)
    for sweep, members in sorted(by_sweep.items()):
        fig, (loss_ax, score_ax, time_ax) = plt.subplots(1, 3, figsize=(13, 4.4))
        labels = run_names(members)
        for r in members:
            scored = [p for p in r.epoch_points if getattr(p, key) is not None]
            colour = score_ax.plot([p.epoch for p in scored], [getattr(p, key) for p in scored], marker="o",
                                   label=labels[r.run])[0].get_color()
            tested = [p for p in r.epoch_points if key in TEST_SCORES and getattr(p, TEST_SCORES[key]) is not None]
            if tested:
                score_ax.plot([p.epoch for p in tested], [getattr(p, TEST_SCORES[key]) for p in tested], marker="^",
                              linestyle="--", color=colour, label=f"{labels[r.run]}: test split")
            validated = [p for p in r.epoch_points if p.val_loss is not None]
            if validated:
                loss_ax.plot([p.epoch for p in validated], [p.val_loss for p in validated], marker="s", color=colour)
            timed = [p for p in scored if p.step in r.progress]
            if timed:
                time_ax.plot([r.progress[p.step][1] for p in timed], [getattr(p, key) for p in timed], marker="o",
                             color=colour)
        for ax, xlabel, ylabel in ((loss_ax, "epoch", "validation loss (nats/token)"), (score_ax, "epoch", label),
                                   (time_ax, "training time (s: the slowest rank's steps)", label)):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
        for ax in (loss_ax, score_ax):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (score_ax, time_ax):
            ax.set_ylim(bottom=0)
        fig.suptitle(f"Validation loss and {label} per epoch, {label} vs training time: {sweep}", fontsize=10)
        if any(key in TEST_SCORES and getattr(p, TEST_SCORES[key]) is not None for r in members
               for p in r.epoch_points):
            footnote(fig, f"Dashed, triangles: {label} of the test split (validation: solid, circles).")
        legend(fig)
        figs.save(fig, stem(key, sweep), sweep)
    return bool(by_sweep)


def _expert_load(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """One figure per sweep with mixtures of experts: the router's load-balancing loss, the busiest expert's tokens
    over the mean's (1: balanced) and, where experts are split (parallel.ep), rank 0's share of the step in
    all-to-all, against optimizer steps, one line per run."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if r.expert_load:
            by_sweep.setdefault(r.sweep, []).append(r)
    for sweep, members in sorted(by_sweep.items()):
        split = any(math.isfinite(point[3]) for r in members for point in r.expert_load)
        fig, axes = plt.subplots(1, 3 if split else 2, figsize=(16 if split else 11, 4.2))
        labels = run_labels(members)
        for r in members:
            steps, aux, load, share = zip(*r.expert_load, strict=True)
            colour = axes[0].plot(steps, aux, linewidth=1, label=labels[r.run])[0].get_color()
            axes[1].plot(steps, load, linewidth=1, color=colour)
            if split:
                axes[2].plot(steps, share, linewidth=1, color=colour)
        axes[1].axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ylabels = ["load-balancing loss (top-k: balanced)", "busiest expert's tokens / mean (1: balanced)",
                   "share of the step in all-to-all (rank 0)"]
        for ax, ylabel in zip(axes, ylabels, strict=False):
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(ylabel)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle(f"Expert load: {sweep}", fontsize=10)
        legend(fig)
        figs.save(fig, stem("expert_load", sweep), sweep)
    return bool(by_sweep)


def _axes(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """Job tokens/s against each key a sweep varies besides the GPU count (and --x), one line per series."""
    per_axis: dict[str, list[RunMetrics]] = {}
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if r.job_tokens_per_s is not None:
            by_sweep.setdefault(r.sweep, []).append(r)
    for members in by_sweep.values():
        if not compared(members[0], figs.group_by):
            continue  # runs outside a sweep differ by accident, not along an axis: listed, never drawn as one
        for key in sweep_axes(members):
            if key != figs.x:
                per_axis.setdefault(key, []).extend(members)
    for key, data in sorted(per_axis.items()):
        fig, ax = plt.subplots()
        values = [key_value(r, key) for r in data]
        at = x_positions(ax, values, category_order(data, key))
        shown: list[Mark] = []
        lines = series(data, key, figs.group_by)
        for i, (label, members) in enumerate(lines.items()):
            points = marks(members, key, _job)
            if categorical(values):  # categories in a meaningful order, as bars: a line between them means nothing
                draw_bars(ax, points, at, (i, len(lines)), label=label)
                ax.grid(axis="x", visible=False)
            else:
                draw_marks(ax, points, at, label=label)
            shown += points
        ax.set_xlabel(key)
        ax.set_ylabel(JOB_RATE)
        ax.set_ylim(bottom=0)
        ax.set_title(f"Throughput vs {key}", fontsize=9)
        footnote(fig, error_note(shown, ONE_RUN_STD))
        legend(fig)
        figs.save(fig, stem("throughput_vs", key.rpartition(".")[2]), key)
    return bool(per_axis)


def _communication(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """One figure per sweep that varies parallel.grad_comm and logged its bytes: the MB one rank sent per step as
    bars by grad_comm (fp32 first, then by bytes), each labelled with its ratio to fp32, and the step time beside
    them, which says whether sending fewer bytes bought anything."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if "total" in r.comm_bytes and r.step_time[0] is not None:
            by_sweep.setdefault(r.sweep, []).append(r)
    ratios = fp32_ratios(runs)
    drawn = False
    for sweep, members in sorted(by_sweep.items()):
        values = [key_value(r, GRAD_COMM) or "fp32" for r in members]
        if len(set(values)) < 2:
            continue
        fig, (bytes_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.4))
        rank = category_order(members, GRAD_COMM)
        at = x_positions(bytes_ax, values, rank)
        x_positions(time_ax, values, rank)
        lines = series(members, GRAD_COMM, figs.group_by)
        shown: list[Mark] = []
        for i, (label, line) in enumerate(lines.items()):
            sent = marks(line, GRAD_COMM, lambda r: (r.comm_bytes["total"] / 1e6, None))
            colour = draw_bars(bytes_ax, sent, at, (i, len(lines)), label=label)
            for m in sent:
                known = [ratios[r.run] for r in m.runs if r.run in ratios]
                if len(known) == len(m.runs):
                    bytes_ax.annotate(f"{statistics.fmean(known):.2f}×", (bar_x(at(m.x), (i, len(lines))), m.high),
                                      textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
            times = marks(line, GRAD_COMM, lambda r: tuple(None if v is None else v * 1e3 for v in r.step_time))
            draw_bars(time_ax, times, at, (i, len(lines)), color=colour)
            shown += times
        for ax, ylabel in ((bytes_ax, "MB one rank sent per step (mean over ranks)"),
                           (time_ax, "step time (ms, mean over ranks)")):
            ax.set_xlabel(GRAD_COMM)
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(axis="x", visible=False)
        bytes_ax.set_ylim(top=1.15 * bytes_ax.get_ylim()[1])  # room for the ratio labels
        bytes_ax.set_title("Bytes sent per step (labels: ratio to fp32)", fontsize=9)
        time_ax.set_title("Step time", fontsize=9)
        fig.suptitle(f"Communication vs {GRAD_COMM}: {sweep}", fontsize=10)
        footnote(fig, "step time " + error_note(shown, "± sample std over its kept steps"))
        legend(fig)
        figs.save(fig, stem("communication", sweep), sweep)
        drawn = True
    return drawn


def _point_bar(p: Point, value: Callable[[RunMetrics], float | None], at: int) -> Mark | None:
    """A point's bar at row `at`: the mean of its runs' values, its error bar min-max over them (its repeats); None
    where no run has a value."""
    values = [v for r in p.runs if (v := value(r)) is not None]
    if not values:
        return None
    return Mark(at, statistics.fmean(values), min(values), max(values), p.runs)


def _peak_gb(r: RunMetrics) -> float | None:
    return None if r.peak_mem is None else r.peak_mem[1] / 1e9


MISSING = "–"  # where a point has no value: no bar, which would read as 0


def _bars(ax: plt.Axes, points: list[Point], value: Callable[[RunMetrics], float | None], slot: tuple[int, int],
          **style: Any) -> list[Mark]:
    """The points' values as horizontal bars, one row per point (slot: this series' place among those sharing a
    row), error bars where a point has repeats, MISSING at the place of a point without a value; the bars drawn."""
    bars = [bar for i, p in enumerate(points) if (bar := _point_bar(p, value, i)) is not None]
    if bars:
        errors = [[m.y - m.low for m in bars], [m.high - m.y for m in bars]] if any(m.repeated for m in bars) else None
        ax.barh([bar_x(m.x, slot) for m in bars], [m.y for m in bars], 0.8 / slot[1], xerr=errors, capsize=3, **style)
    for i in sorted(set(range(len(points))) - {bar.x for bar in bars}):
        ax.text(0, bar_x(i, slot), f" {MISSING}", ha="left", va="center")
    return bars


def _comparison(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """One figure per compared sweep whose runs log accuracy (the course's comparison of methods): its points side by
    side, one row each (named by the keys the sweep varies, as summary.md names them), in four panels: the fullest
    rank's peak memory, job tokens/s, epoch time and final accuracy (top-1, and top-5 hatched beside it where
    logged). A point without a value (a language run's accuracy, a peak no rank measured) shows – at its place,
    never a bar of 0."""
    by_sweep: dict[str, list[tuple[Point, str]]] = {}
    for p, name in named_points([r for r in runs if compared(r, figs.group_by)]):
        by_sweep.setdefault(p.first.sweep, []).append((p, name))
    drawn = False
    for sweep, named in sorted(by_sweep.items()):
        points = [p for p, _ in named]
        if len(points) < 2 or not any(r.accuracy_curve for p in points for r in p.runs):
            continue
        fig, axes = plt.subplots(1, 4, sharey=True, figsize=figure_size(16.0, 1.5 + 0.6 * len(points)))
        memory_ax, rate_ax, time_ax, accuracy_ax = axes
        gpu = all(r.on_gpu for p in points for r in p.runs)
        shown = [*_bars(memory_ax, points, _peak_gb, (0, 1)),
                 *_bars(rate_ax, points, lambda r: r.job_tokens_per_s, (0, 1)),
                 *_bars(time_ax, points, lambda r: r.epoch_time[0], (0, 1))]
        top5 = any(r.top5_curve for p in points for r in p.runs)
        slots = 2 if top5 else 1
        _bars(accuracy_ax, points, lambda r: r.final_accuracy, (0, slots), color="tab:blue", label="top-1")
        if top5:
            _bars(accuracy_ax, points, lambda r: r.final_accuracy_top5, (1, slots), color="tab:blue", alpha=0.5,
                  hatch="//", label="top-5 (hatched)")
        for ax, title, xlabel in ((memory_ax, "Peak memory, fullest rank",
                                   "GB (CUDA's allocator)" if gpu else "GB (CPU: the process's peak RSS)"),
                                  (rate_ax, "Throughput", JOB_RATE.replace(" (", "\n(")),
                                  (time_ax, "Epoch time", "training time per epoch (s)"),
                                  (accuracy_ax, "Accuracy, final", "validation accuracy")):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_xlim(left=0)
            ax.grid(axis="y", visible=False)
        memory_ax.set_yticks(range(len(points)), [fill(name, 36) for _, name in named], fontsize=7)
        memory_ax.invert_yaxis()  # the sweep's first point on top, as in summary.md
        accuracy_ax.set_xlim(0, 1)
        accuracy_ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        fig.suptitle(f"Methods side by side: {sweep}", fontsize=10)
        footnote(fig, error_note(shown, "none (one run)"), f"{MISSING}: no value (a run that logs no accuracy, a peak "
                 "no rank measured). Epoch time: the epoch records' (summary.md's column); an epoch that "
                 "train.max_steps cut short is timed as it ran.")
        legend(fig)
        figs.save(fig, stem("comparison", sweep), sweep)
        drawn = True
    return drawn


GANTT_COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def _gantt(ax: plt.Axes, timeline: Timeline, ranks: int, title: str) -> None:
    """A timeline on one axes: ranks down, time across, F/B/W coloured, micro-batch numbers on the bars
    (a lighter shade for later virtual stages)."""
    for rank, action, start, end in timeline.spans:
        later_chunk = action.stage >= ranks
        ax.barh(rank, end - start, left=start, color=GANTT_COLOURS[action.kind], edgecolor="white",
                alpha=0.55 if later_chunk else 1.0)
        ax.text((start + end) / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_title(title, fontsize=9)
    ax.grid(False)


def _gantt_legend(ax: plt.Axes) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in GANTT_COLOURS.values()]
    ax.legend(handles, ["forward", "backward (input)", "backward (weights)"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False)


def mean_costs(trace: Timeline) -> dict[str, float]:
    """Mean duration of each action kind (F, B, W) in a timeline; 0 for a kind it lacks."""
    costs = {kind: [end - start for _, action, start, end in trace.spans if action.kind == kind] for kind in COMPUTE}
    return {kind: statistics.fmean(durations) if durations else 0.0 for kind, durations in costs.items()}


def simulated_timeline(run: RunMetrics, trace: Timeline) -> Timeline:
    """The run's schedule simulated with its traced step's mean F/B/W durations: what the schedule gives when
    every stage is equally fast and messages are free, so the gap to the measured timeline is imbalance and
    communication. A whole backward (no W) is B's cost; train.grad_accum passes run back to back, each with
    its own micro-batch numbers, as the engine runs them."""
    cost = mean_costs(trace)
    passes = int(run.params.get("train.grad_accum", 1))
    lists = [[replace(a, microbatch=a.microbatch + k * run.chunks) for k in range(passes) for a in actions]
             for actions in schedule(run.pp_schedule, len(trace.idle), run.chunks, run.pp_virtual)]
    return simulate(lists, cost["F"], cost["B"], cost["W"])


def _timelines(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """Per engine run, its traced step's measured timeline above the simulated one on the same time axis."""
    traced = [(r, r.pp_trace) for r in runs if r.pp_trace is not None and not r.bubble_flagged]
    keys = point_keys([r for r, _ in traced])
    for r, trace in traced:
        ranks, simulated = len(trace.idle), simulated_timeline(r, trace)
        cost = ", ".join(f"{kind} {seconds * 1e3:.3g} ms" for kind, seconds in mean_costs(trace).items() if seconds)
        actions = max(sum(row == rank for row, *_ in trace.spans) for rank in range(ranks))
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=figure_size(max(8.0, 0.3 * actions), 0.9 * ranks + 3))
        _gantt(axes[0], trace, ranks, f"measured, step {r.pp_trace_step}: bubble {trace.bubble:.3f} "
                                      "(logged idle share, mean over stage ranks)")
        _gantt(axes[1], simulated, ranks, f"simulated with the step's mean {cost}: bubble {simulated.bubble:.3f}")
        axes[1].set_xlim(0, max(trace.makespan, simulated.makespan))
        axes[1].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * 1e3:g}"))
        axes[1].set_xlabel("time from the step's start (ms)")
        _gantt_legend(axes[0])
        fig.suptitle(f"Pipeline timeline: {r.pp_mode}, m={r.chunks}", fontsize=10)  # the run, however long, below
        footnote(fig, f"run {r.run}; closed-form bubble {r.bubble_theory:.3f} (unit costs)")
        name = point_name(r, keys, file=True) if keys else ""
        figs.save(fig, stem("pipeline_timeline", name) if name else "pipeline_timeline", r.run)
    return bool(traced)


def _bubbles(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """Engine runs' measured bubble (mean over stage ranks, ± std over steps; min-max over repeats) against
    micro-batches, one line per schedule, stage count and virtual stages, each with its closed form dashed."""
    data = [r for r in runs if r.engine and r.bubble_measured is not None and not r.bubble_flagged]
    if not data:
        return False
    groups: dict[tuple[str, int, int], list[RunMetrics]] = {}
    for r in data:
        groups.setdefault((r.pp_schedule, r.devices, r.pp_virtual), []).append(r)
    fig, ax = plt.subplots()
    shown: list[Mark] = []
    forms: dict[tuple[tuple[int, float], ...], list[str]] = {}  # closed-form curve -> the lines it belongs to
    for (name, p, v), members in sorted(groups.items()):
        points = marks(members, CHUNKS, lambda r: (r.bubble_measured, r.bubble_std))
        label = f"{name} P={p}" + (f" V={v}" if v > 1 else "")
        draw_marks(ax, points, float, label=label)
        shown += points
        ms = range(min(r.chunks for r in data), max(r.chunks for r in data) + 1)
        forms.setdefault(tuple((m, closed_form_bubble(name, p, m, v)) for m in ms), []).append(label)
    for (curve, labels), dashes in zip(forms.items(), cycle(("--", "-.", ":", (0, (5, 1)))), strict=False):
        ax.plot(*zip(*curve, strict=True), **{**REFERENCE, "linestyle": dashes},
                label=f"closed form: {', '.join(labels)}")
    ax.set_xlabel("micro-batches per batch (chunks m)")
    ax.set_xticks(sorted({r.chunks for r in data}))
    ax.set_ylabel("bubble (idle share of the window)")
    ax.set_ylim(bottom=0)
    ax.set_title("Pipeline bubble vs micro-batches (grey: closed forms)", fontsize=9)
    footnote(fig, error_note(shown, "± sample std over its kept steps"), _shortfall(data))
    legend(fig)
    figs.save(fig, "pipeline_bubble")
    return True


STATE_COLOURS = dict(zip(STATE_BYTES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
HPZ_COLOUR, HPZ_LABEL = "tab:purple", "hpZ copy"  # parallel.hpz's secondary parameters, stacked on the state
HOST_COLOUR, HOST_LABEL = "tab:gray", "on the host"  # parallel.offload's state, stacked on the device's
# Line colours that leave red to the ⚠ mark, so that a flagged point stands out on every line.
LINE_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                "tab:cyan", "tab:gray")


def _strategy_order(strategy: str) -> tuple[int, str]:
    """Strategies in the table's order (least sharded first), any other after them by name."""
    order = [*DP_STRATEGIES]
    return (order.index(strategy) if strategy in order else len(order), strategy)


def _mode(r: RunMetrics) -> str:
    """A run's pipeline mode for the memory figures: blank for single, whose ranks hold the whole model."""
    return "" if r.pp_mode == "single" else r.pp_mode


def _memory(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """Training-state MB per rank (mean over ranks) as stacked parameter, gradient and optimizer bars (and hpZ's
    secondary copy where a run keeps one, and the state parallel.offload put on the host), one per run,
    grouped by data-parallel size W (dp × cp), strategy and pipeline mode, each with its closed form as a black bar; a
    run off its closed form is hatched and marked ⚠, so that it does not read as a match. Drawn only where runs hold
    their state in more than one way (strategy and W), or one is off its closed form: bars of one layout that match
    their closed forms compare nothing."""
    groups: dict[tuple[int, str, str], list[tuple[RunMetrics, MemoryUse]]] = {}
    for r in runs:
        if r.memory is not None:
            groups.setdefault((r.replicas, r.memory.strategy, _mode(r)), []).append((r, r.memory))
    off = any(mem.mismatched for members in groups.values() for _, mem in members)
    if len({(w, strategy) for w, strategy, _ in groups}) < 2 and not off:
        return False
    keys = sorted(groups, key=lambda k: (k[0], *_strategy_order(k[1]), k[2]))
    bars = sum(len(members) for members in groups.values())
    fig, ax = plt.subplots(figsize=figure_size(max(6.4, 0.6 * (bars + len(groups)) + 2), 4.8))
    above = blended_transform_factory(ax.transData, ax.transAxes)
    x, ticks, names, labelled = 0.0, [], [], set[str]()

    def label(name: str) -> str | None:
        """The legend names each part once, not once per bar."""
        if name in labelled:
            return None
        labelled.add(name)
        return name

    for i, (w, strategy, mode) in enumerate(keys):
        if i:
            ax.axvline(x - 0.8, color="grey", linewidth=0.8, alpha=0.5)
        start = x
        for r, mem in sorted(groups[w, strategy, mode], key=lambda pair: pair[0].run):
            bottom = 0.0
            for part, colour in STATE_COLOURS.items():
                ax.bar(x, mem.mean[part] / 1e6, 0.7, bottom=bottom, color=colour, edgecolor="white",
                       hatch="//" if mem.mismatched else None, label=label(part))
                bottom += mem.mean[part] / 1e6
            extras = ((mem.hpz[0] if mem.hpz else None, HPZ_COLOUR, HPZ_LABEL),
                      (mem.mean.get("host"), HOST_COLOUR, HOST_LABEL))
            for held, colour, name in extras:
                if held is not None:
                    ax.bar(x, held / 1e6, 0.7, bottom=bottom, color=colour, edgecolor="white",
                           hatch="//" if mem.mismatched else None, label=label(name))
                    bottom += held / 1e6
            if mem.closed_form is not None:
                ax.plot([x - 0.42, x + 0.42], [mem.closed_form / 1e6] * 2, color="black", linewidth=2.5,
                        label=label("closed form"))
            if mem.mismatched:
                ax.text(x, bottom, OFF_MARK, ha="center", va="bottom", color=OFF_COLOUR)
            ticks.append(x)
            names.append(r.run_id.replace(",", ",\n"))  # a sweep point's keys one a line: long ids side by side
            x += 1.0
        ax.text((start + x - 1.0) / 2, 1.01, f"{strategy}\nW={w}" + (f"\n{mode}" if mode else ""), transform=above,
                ha="center", va="bottom", fontsize=8)
        x += 0.6
    ax.set_xticks(ticks, names, rotation=90, fontsize=7)
    ax.set_xlim(-0.6, x - 0.6)
    ax.set_ylabel("training state per rank (MB, mean over ranks)")
    ax.set_title("Memory per rank: parameters, gradients, optimizer state (black: closed form)", fontsize=10,
                 pad=40 if any(mode for *_, mode in keys) else 28)
    ax.grid(axis="x", visible=False)
    handles, entries = ax.get_legend_handles_labels()
    if off:
        handles.append(Patch(facecolor="white", edgecolor=OFF_COLOUR, hatch="//"))
        entries.append(f"{OFF_MARK} off its closed form")
    legend(fig, handles, entries)
    figs.save(fig, "memory_per_rank")
    return True


def _memory_lines(runs: list[RunMetrics]) -> dict[tuple[str, str, int], dict[int, list[MemoryUse]]]:
    """Memory records by line (strategy, pipeline mode, parameters per rank) and data-parallel size W: a line
    holds one model's state across W, so a sweep of model sizes does not read as a change with W. A run of one
    replica holds the whole model under any strategy: it starts every line of its model and mode (a line of its
    own, without a strategy, where no run of them has more replicas)."""
    lines: dict[tuple[str, str, int], dict[int, list[MemoryUse]]] = {}
    alone = [r for r in runs if r.memory is not None and r.replicas == 1]
    for r in runs:
        if r.memory is not None and r.replicas > 1:
            line = lines.setdefault((r.memory.strategy, _mode(r), round(r.memory.params)), {})
            line.setdefault(r.replicas, []).append(r.memory)
    for r in alone:
        model = (_mode(r), round(r.memory.params))
        for key in [k for k in lines if k[1:] == model] or [(r.memory.strategy, *model)]:
            lines.setdefault(key, {}).setdefault(1, []).append(r.memory)
    return lines


def _memory_point(records: list[MemoryUse]) -> tuple[float, float | None, bool]:
    """What a line draws at one W: the mean total, the mean closed form, and whether a run is off it."""
    closed = [mem.closed_form for mem in records if mem.closed_form is not None]
    return (statistics.fmean(mem.mean["total"] for mem in records), statistics.fmean(closed) if closed else None,
            any(mem.mismatched for mem in records))


def _memory_vs_world_size(runs: list[RunMetrics], figs: FigureSet) -> bool:
    """Training-state MB per rank (mean over ranks, and over runs at the same W) against the data-parallel size W,
    one line per strategy with its closed form dashed in the same colour; a W where a run is off its closed form
    is marked ⚠, so that it does not read as a match. Drawn only when some line spans two or more W."""
    lines = _memory_lines(runs)
    if not any(len(by_w) > 1 for by_w in lines.values()):
        return False
    models = len({(mode, n) for _, mode, n in lines}) > 1  # name the model only where lines differ in it
    fig, ax = plt.subplots()
    flagged = False
    keys = sorted(lines, key=lambda k: (*_strategy_order(k[0]), *k[1:]))
    names = {key: key[0] + (f" {key[1]}" if key[1] else "") + (f", N={key[2]:,}" if models else "") for key in keys}
    drawn: dict[tuple, list[tuple[str, str, int]]] = {}  # a line's points -> the lines that have them all
    for key in keys:
        by_w = lines[key]
        drawn.setdefault(tuple((w, _memory_point(by_w[w])) for w in sorted(by_w)), []).append(key)
    for i, same in enumerate(drawn.values()):  # lines on one another are drawn once, named together
        (strategy, mode, n), colour = same[0], LINE_COLOURS[i % len(LINE_COLOURS)]
        by_w = lines[strategy, mode, n]
        ws = sorted(by_w)
        label = " = ".join(names[key] for key in same) + (" (identical)" if len(same) > 1 else "")
        totals = [statistics.fmean(mem.mean["total"] for mem in by_w[w]) / 1e6 for w in ws]
        ax.plot(ws, totals, marker="o", color=colour, label=label)
        closed = [[mem.closed_form for mem in by_w[w] if mem.closed_form is not None] for w in ws]
        if all(closed):  # one strategy per line: every run has a closed form, or none does
            ax.plot(ws, [statistics.fmean(c) / 1e6 for c in closed], linestyle="--", marker="x", color=colour)
        for w, total in zip(ws, totals, strict=True):
            if any(mem.mismatched for mem in by_w[w]):
                ax.plot(w, total, marker="o", markerfacecolor="white", markeredgecolor=OFF_COLOUR,
                        linestyle="none", label=None if flagged else f"{OFF_MARK} off its closed form")
                ax.annotate(OFF_MARK, (w, total), textcoords="offset points", xytext=(0, 5), ha="center",
                            color=OFF_COLOUR)
                flagged = True
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ws = sorted({w for by_w in lines.values() for w in by_w})
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("data-parallel size W (dp × cp)")
    ax.set_ylabel("training state per rank (MB, mean over ranks)")
    ax.set_title("Memory per rank vs W (dashed, ×: closed form)")
    starts = {w: n for w, n in Counter(w for line in drawn for w, _ in line).items() if n > 1}
    if 1 in starts:
        footnote(fig, f"W=1: one run of one replica, which holds the whole state under any strategy, starts "
                      f"{starts[1]} of the lines (their markers coincide there).")
    legend(fig)
    figs.save(fig, "memory_vs_world_size")
    return True


OWN_FIGURES = ("time_vs_*", "throughput_vs_*", "speedup_vs_*", "pipeline_vs_model_parallel", "loss_*", "bleu_*",
               "answer_accuracy_*", "expert_load_*", "pipeline_timeline*", "pipeline_bubble", "memory_per_rank",
               "memory_vs_world_size", "communication_*", "comparison_*")


def make_figures(runs: list[RunMetrics], figs: FigureSet, say: Callable[[str], None] = print) -> list[Path]:
    """Write every figure that has data into figs (its folder, format, dpi and grouping); name each skipped one,
    and each warning matplotlib raised while drawing, through `say`. Returns the files written, each once.

    Figures of an earlier report in the folder (in any format) are removed first, so none outlives its data."""
    for pattern in OWN_FIGURES:
        for suffix in FORMATS:
            for stale in figs.out_dir.glob(f"{pattern}.{suffix}"):
                stale.unlink()
    x, fmt = figs.x, figs.fmt
    along = slug((x or "gpus").rpartition(".")[2], NAME_MAX)
    single = "" if x else "single-mode "
    adhoc = "" if figs.group_by else " (runs outside a sweep folder are compared only under --group-by)"
    drawings: tuple[tuple[str, Callable[[list[RunMetrics], FigureSet], bool], str], ...] = (
        (f"time_vs_{along}", partial(_scaling, metric="time"), f"no {single}run of a sweep with an epoch time{adhoc}"),
        (f"throughput_vs_{along}", partial(_scaling, metric="tokens"),
         f"no {single}run of a sweep with a throughput{adhoc}"),
        (f"speedup_vs_{along}", _speedup, f"no {single}run with a speedup over another run that is not flagged "
                                          f"(a sweep needs its 1-GPU run as the baseline){adhoc}"),
        ("pipeline_vs_model_parallel", _pipeline, "no model- or pipeline-parallel run"),
        ("loss_*", _losses, "no run logged a loss"),
        ("bleu_*", partial(_scores, key="bleu", label="BLEU"), "no run logged a bleu in its epoch records"),
        ("answer_accuracy_*", partial(_scores, key="answer_accuracy", label="answer accuracy"),
         "no run logged an answer_accuracy in its epoch records"),
        ("expert_load_*", _expert_load, "no mixture-of-experts run logged its expert load"),
        ("communication_*", _communication, f"no sweep varies {GRAD_COMM} with its bytes logged (comm_bytes)"),
        ("comparison_*", _comparison, "no sweep of two or more points logs accuracy (data.task=classify)"),
        ("throughput_vs_<axis>", _axes, "no sweep varies a key other than the GPU count" + (f" and {x}" if x else "")),
        ("pipeline_timeline", _timelines, "no multi-process pipeline run (parallel.pp > 1) logged a step's "
                                          "pp_timeline on every stage"),
        ("pipeline_bubble", _bubbles, "no multi-process pipeline run (parallel.pp > 1) with a measured bubble in "
                                      "[0, 1]"),
        ("memory_per_rank", _memory, "no two runs that logged a memory record hold their training state differently "
                                     "(data-parallel strategy and size W), and none is off its closed form"),
        ("memory_vs_world_size", _memory_vs_world_size, "no strategy has memory records at two or more "
                                                        "data-parallel sizes W (of one model and pipeline mode)"),
    )
    with plt.rc_context(STYLE):
        for name, draw, why in drawings:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                drawn = draw(runs, figs)
            if not drawn:
                say(f"figure {name}.{fmt} skipped: {why}")
            for message in dict.fromkeys(str(w.message) for w in caught):
                say(f"figure {name}.{fmt}: matplotlib warned: {message}")
    return figs.written


def schedule_gantt(timeline: Timeline, ranks: int, title: str, path: Path) -> Path:
    """A simulated pipeline schedule's Gantt chart, in cost units."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=figure_size(max(6.4, timeline.makespan * 0.25), 0.5 * ranks + 1.5))
        _gantt(ax, timeline, ranks, title)
        ax.set_xlabel("time (cost units)")
        _gantt_legend(ax)
        write(fig, path)
    return path
