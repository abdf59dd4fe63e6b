"""Scaling, pipeline, loss and sweep-axis figures, one consistent style, PNG via the Agg backend.

A figure without data is skipped with a message: an empty plot in a report reads as a result.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from analysis.aggregate import SHARDED_STATE, STATE_BYTES, MemoryUse, RunMetrics, sweep_axes  # noqa: E402
from gptpar.atomic import write_error
from gptpar.parallel.pipeline.schedules import COMPUTE, Timeline, closed_form_bubble, schedule, simulate
from gptpar.run.names import slug

STYLE = {
    "figure.figsize": (6.4, 4.4), "figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8, "lines.markersize": 5,
}
MAX_LEGEND = 12


def _series(runs: list[RunMetrics]) -> dict[str, list[RunMetrics]]:
    """Runs grouped into lines by sweep and by the keys the sweep varies besides the GPU count."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        by_sweep.setdefault(r.sweep, []).append(r)
    series: dict[str, list[RunMetrics]] = {}
    for sweep, members in sorted(by_sweep.items()):
        axes = sweep_axes(members)
        for r in members:
            label = ", ".join(f"{k.split('.')[-1]}={r.params.get(k)}" for k in axes)
            series.setdefault(f"{sweep} {label}".strip() if len(by_sweep) > 1 or not label else label, []).append(r)
    return series


def _errorbar(ax: plt.Axes, xs: list, pairs: list[tuple[float | None, float | None]], **style) -> str | None:
    """Mean ± std points, leaving out runs without the value; the line's colour, if drawn."""
    points = [(x, mean, std or 0.0) for x, (mean, std) in zip(xs, pairs, strict=True) if mean is not None]
    if not points:
        return None
    x, y, err = (list(column) for column in zip(*points, strict=True))
    return ax.errorbar(x, y, yerr=err, marker="o", capsize=3, **style)[0].get_color()


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [x for x, _ in points], [y for _, y in points]


def _save(fig: plt.Figure, path: Path, written: list[Path]) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:  # a full disk: the writer's error does not name the file
        raise write_error(path, exc) from None
    finally:
        plt.close(fig)
    written.append(path)


def _legend(ax: plt.Axes) -> None:
    if 0 < len(ax.get_legend_handles_labels()[0]) <= MAX_LEGEND:
        ax.legend()


def _scaling(runs: list[RunMetrics], path: Path, written: list[Path], metric: str) -> bool:
    """Training time (metric "time") or summed tokens/s ("tokens") against the GPU count."""
    def value(r: RunMetrics) -> tuple[float | None, float | None]:
        return r.epoch_time if metric == "time" else r.tokens_per_s

    data = [r for r in runs if r.pp_mode == "single" and value(r)[0] is not None]
    if not data:
        return False
    fig, ax = plt.subplots()
    for label, members in _series(data).items():
        members = sorted(members, key=lambda r: r.gpus)
        xs = [r.gpus for r in members]
        _errorbar(ax, xs, [value(r) for r in members], label=label or None)
    if metric == "tokens":  # per sweep, linear from its run on the fewest GPUs
        for sweep in sorted({r.sweep for r in data}):
            members = [r for r in data if r.sweep == sweep]
            base = min(members, key=lambda r: (r.gpus, r.run))
            xs = sorted({r.gpus for r in members})
            ax.plot(xs, [base.tokens_per_s[0] * x / base.gpus for x in xs], linestyle="--", color="grey",
                    alpha=0.7, label=f"ideal ({sweep}, from {base.run_id})")
    ax.set_xlabel("GPUs (data-parallel ranks × devices per replica)")
    ax.set_xticks(sorted({r.gpus for r in data}))
    if metric == "time":
        ax.set_ylabel("training time per epoch (s)")
        ax.set_title("Training time vs GPU count")
    else:
        ax.set_ylabel("throughput (tokens/s, summed over DP ranks)")
        ax.set_title("Throughput vs GPU count (dashed: ideal linear scaling)")
    _legend(ax)
    _save(fig, path, written)
    return True


def _pipeline(runs: list[RunMetrics], path: Path, written: list[Path]) -> bool:
    """Model parallel (horizontal lines) against pipeline parallel per chunk count."""
    data = [r for r in runs if r.pp_mode in ("model_parallel", "pipeline_parallel")]
    if not data:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    panels = (("epoch_time", "training time per epoch (s)"),
              ("tokens_per_s", "throughput (tokens/s, summed over DP)"))
    groups: dict[tuple[str, int, int], list[RunMetrics]] = {}
    for r in data:
        groups.setdefault((r.sweep, r.devices, r.dp), []).append(r)
    chunks = sorted({r.chunks for r in data if r.pp_mode == "pipeline_parallel"}) or [1]
    for (sweep, p, dp), members in sorted(groups.items()):
        name = f"{sweep} p={p}" + (f" dp={dp}" if dp > 1 else "")
        pipe = sorted((r for r in members if r.pp_mode == "pipeline_parallel"), key=lambda r: r.chunks)
        model = [r for r in members if r.pp_mode == "model_parallel"]
        for ax, (attr, _) in zip(axes, panels, strict=False):
            color = _errorbar(ax, [r.chunks for r in pipe], [getattr(r, attr) for r in pipe],
                              label=f"pipeline {name}")
            for r in model:
                if getattr(r, attr)[0] is not None:
                    ax.axhline(getattr(r, attr)[0], linestyle="--", color=color,
                               label=f"model parallel {name}")
        if pipe:
            ms = [r.chunks for r in pipe]
            theory_line = axes[2].plot(ms, [r.bubble_theory for r in pipe], linestyle="--",
                                       label=f"theory (p-1)/(m+p-1), {name}")
            measured = [(r.chunks, r.bubble_measured) for r in pipe if r.bubble_measured is not None]
            if measured:
                axes[2].plot(*_xy(measured), marker="o", linestyle="none",
                             color=theory_line[0].get_color(), label=f"measured {name}")
    for ax, (_, ylabel) in zip(axes, panels, strict=False):
        ax.set_ylabel(ylabel)
    axes[2].set_ylabel("bubble fraction of step time")
    axes[2].set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("micro-batches per batch (chunks m)")
        ax.set_xticks(chunks)
        _legend(ax)
    fig.suptitle("Model parallel (dashed lines) vs pipeline parallel")
    _save(fig, path, written)
    return True


def _losses(runs: list[RunMetrics], out_dir: Path, written: list[Path]) -> bool:
    """One figure per sweep: training loss per step, validation loss as markers."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if r.loss_curve:
            by_sweep.setdefault(r.sweep, []).append(r)
    for sweep, members in sorted(by_sweep.items()):
        fig, ax = plt.subplots()
        for r in members:
            line = ax.plot(*_xy(r.loss_curve), linewidth=1, label=r.run_id)
            if r.val_curve:
                ax.plot(*_xy(r.val_curve), marker="s", linestyle="none", color=line[0].get_color())
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats/token; squares: validation)")
        ax.set_title(f"Loss curves: {sweep}")
        _legend(ax)
        _save(fig, out_dir / f"loss_{slug(sweep or 'top-level')}.png", written)
    return bool(by_sweep)


def _axes(runs: list[RunMetrics], out_dir: Path, written: list[Path]) -> bool:
    """Throughput against each swept key other than the GPU count, one line per sweep and GPU count."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if r.tokens_per_s[0] is not None:
            by_sweep.setdefault(r.sweep, []).append(r)
    per_axis: dict[str, list[tuple[str, RunMetrics]]] = {}
    for sweep, members in by_sweep.items():
        for key in sweep_axes(members):
            per_axis.setdefault(key, []).extend((sweep, r) for r in members)
    for key, pairs in sorted(per_axis.items()):
        values = sorted({r.params.get(key) for _, r in pairs}, key=lambda v: (isinstance(v, str), v))
        numeric = all(isinstance(v, (int, float)) for v in values)
        lines: dict[str, list[RunMetrics]] = {}
        for sweep, r in pairs:
            lines.setdefault(f"{sweep} GPUs={r.gpus}" + (f" {r.pp_mode}" if r.pp_mode != "single" else ""),
                             []).append(r)
        fig, ax = plt.subplots()
        for label, members in sorted(lines.items()):
            members = sorted(members, key=lambda r: values.index(r.params.get(key)))
            xs = [r.params.get(key) if numeric else values.index(r.params.get(key)) for r in members]
            _errorbar(ax, xs, [r.tokens_per_s for r in members], label=label)
        if not numeric:
            ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_xlabel(key)
        ax.set_ylabel("throughput (tokens/s, summed over DP)")
        ax.set_title(f"Throughput vs {key}")
        _legend(ax)
        _save(fig, out_dir / f"throughput_vs_{slug(key.split('.')[-1])}.png", written)
    return bool(per_axis)


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


def _timelines(runs: list[RunMetrics], out_dir: Path, written: list[Path]) -> bool:
    """Per engine run, its traced step's measured timeline above the simulated one on the same time axis."""
    traced = [(r, r.pp_trace) for r in runs if r.pp_trace is not None and not r.bubble_flagged]
    for r, trace in traced:
        ranks, simulated = len(trace.idle), simulated_timeline(r, trace)
        cost = ", ".join(f"{kind} {seconds * 1e3:.3g} ms" for kind, seconds in mean_costs(trace).items() if seconds)
        actions = max(sum(row == rank for row, *_ in trace.spans) for rank in range(ranks))
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(min(24.0, max(8.0, 0.3 * actions)), 0.9 * ranks + 3))
        _gantt(axes[0], trace, ranks, f"measured, step {r.pp_trace_step}: bubble {trace.bubble:.3f} "
                                      "(logged idle share, mean over stage ranks)")
        _gantt(axes[1], simulated, ranks, f"simulated with the step's mean {cost}: bubble {simulated.bubble:.3f}")
        axes[1].set_xlim(0, max(trace.makespan, simulated.makespan))
        axes[1].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * 1e3:g}"))
        axes[1].set_xlabel("time from the step's start (ms)")
        _gantt_legend(axes[0])
        fig.suptitle(f"{r.run}\n{r.pp_mode}, m={r.chunks}: closed-form bubble {r.bubble_theory:.3f} (unit costs)",
                     fontsize=10)
        name = "pipeline_timeline.png" if len(traced) == 1 else f"pipeline_timeline_{slug(r.run)}.png"
        _save(fig, out_dir / name, written)
    return bool(traced)


def _bubbles(runs: list[RunMetrics], path: Path, written: list[Path]) -> bool:
    """Engine runs' measured bubble (mean over stage ranks, ± std over steps) against micro-batches, one line
    per schedule, stage count and virtual stages, each with its closed form dashed."""
    data = [r for r in runs if r.engine and r.bubble_measured is not None and not r.bubble_flagged]
    if not data:
        return False
    groups: dict[tuple[str, int, int], list[RunMetrics]] = {}
    for r in data:
        groups.setdefault((r.pp_schedule, r.devices, r.pp_virtual), []).append(r)
    fig, ax = plt.subplots()
    for (name, p, v), members in sorted(groups.items()):
        members.sort(key=lambda r: r.chunks)
        label = f"{name} P={p}" + (f" V={v}" if v > 1 else "")
        color = _errorbar(ax, [r.chunks for r in members], [(r.bubble_measured, r.bubble_std) for r in members],
                          label=label)
        ms = list(range(members[0].chunks, members[-1].chunks + 1))
        ax.plot(ms, [closed_form_bubble(name, p, m, v) for m in ms], linestyle="--", marker="x", color=color,
                markevery=sorted({ms.index(r.chunks) for r in members}))
    ax.set_xlabel("micro-batches per batch (chunks m)")
    ax.set_xticks(sorted({r.chunks for r in data}))
    ax.set_ylabel("bubble (idle share of the window, ± std over steps)")
    ax.set_ylim(bottom=0)
    ax.set_title("Pipeline bubble vs micro-batches (dashed: closed form)")
    _legend(ax)
    _save(fig, path, written)
    return True


STATE_COLOURS = dict(zip(STATE_BYTES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
OFF_MARK, OFF_COLOUR = "⚠", "tab:red"  # how both memory figures mark a run off its closed form
# Line colours that leave red to the ⚠ mark, so that a flagged point stands out on every line.
LINE_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                "tab:cyan", "tab:gray")


def _strategy_order(strategy: str) -> tuple[int, str]:
    """Strategies in SHARDED_STATE's order (least sharded first), any other after them by name."""
    order = [*SHARDED_STATE]
    return (order.index(strategy) if strategy in order else len(order), strategy)


def _mode(r: RunMetrics) -> str:
    """A run's pipeline mode for the memory figures: blank for single, whose ranks hold the whole model."""
    return "" if r.pp_mode == "single" else r.pp_mode


def _memory(runs: list[RunMetrics], path: Path, written: list[Path]) -> bool:
    """Training-state MB per rank (mean over ranks) as stacked parameter, gradient and optimizer bars, one per run,
    grouped by data-parallel size W, strategy and pipeline mode, each with its closed form as a black bar; a run
    off its closed form is hatched and marked ⚠, so that it does not read as a match."""
    groups: dict[tuple[int, str, str], list[tuple[RunMetrics, MemoryUse]]] = {}
    for r in runs:
        if r.memory is not None:
            groups.setdefault((r.dp, r.memory.strategy, _mode(r)), []).append((r, r.memory))
    if not groups:
        return False
    keys = sorted(groups, key=lambda k: (k[0], *_strategy_order(k[1]), k[2]))
    bars = sum(len(members) for members in groups.values())
    fig, ax = plt.subplots(figsize=(min(24.0, max(6.4, 0.6 * (bars + len(groups)) + 2)), 4.8))
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
            if mem.closed_form is not None:
                ax.plot([x - 0.42, x + 0.42], [mem.closed_form / 1e6] * 2, color="black", linewidth=2.5,
                        label=label("closed form"))
            if mem.mismatched:
                ax.text(x, bottom, OFF_MARK, ha="center", va="bottom", color=OFF_COLOUR)
            ticks.append(x)
            names.append(r.run_id)
            x += 1.0
        ax.text((start + x - 1.0) / 2, 1.01, f"{strategy}\nW={w}" + (f"\n{mode}" if mode else ""), transform=above,
                ha="center", va="bottom", fontsize=8)
        x += 0.6
    ax.set_xticks(ticks, names, rotation=30, ha="right", fontsize=7)
    ax.set_xlim(-0.6, x - 0.6)
    ax.set_ylabel("training state per rank (MB, mean over ranks)")
    ax.set_title("Memory per rank: parameters, gradients, optimizer state (black: closed form)", fontsize=10,
                 pad=40 if any(mode for *_, mode in keys) else 28)
    ax.grid(axis="x", visible=False)
    handles, entries = ax.get_legend_handles_labels()
    if any(mem.mismatched for members in groups.values() for _, mem in members):
        handles.append(Patch(facecolor="white", edgecolor=OFF_COLOUR, hatch="//"))
        entries.append(f"{OFF_MARK} off its closed form")
    ax.legend(handles, entries)
    _save(fig, path, written)
    return True


def _memory_lines(runs: list[RunMetrics]) -> dict[tuple[str, str, int], dict[int, list[MemoryUse]]]:
    """Memory records by line (strategy, pipeline mode, parameters per rank) and data-parallel size W: a line
    holds one model's state across W, so a sweep of model sizes does not read as a change with W."""
    lines: dict[tuple[str, str, int], dict[int, list[MemoryUse]]] = {}
    for r in runs:
        if r.memory is not None:
            key = (r.memory.strategy, _mode(r), round(r.memory.params))
            lines.setdefault(key, {}).setdefault(r.dp, []).append(r.memory)
    return lines


def _memory_vs_world_size(runs: list[RunMetrics], path: Path, written: list[Path]) -> bool:
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
    for i, (strategy, mode, n) in enumerate(keys):
        by_w, colour = lines[strategy, mode, n], LINE_COLOURS[i % len(LINE_COLOURS)]
        ws = sorted(by_w)
        label = strategy + (f" {mode}" if mode else "") + (f", N={n:,}" if models else "")
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
    ax.set_xlabel("data-parallel size W")
    ax.set_ylabel("training state per rank (MB, mean over ranks)")
    ax.set_title("Memory per rank vs W (dashed, ×: closed form)")
    _legend(ax)
    _save(fig, path, written)
    return True


OWN_FIGURES = ("time_vs_gpus.png", "throughput_vs_*.png", "pipeline_vs_model_parallel.png", "loss_*.png",
               "pipeline_timeline*.png", "pipeline_bubble.png", "memory_per_rank.png",
               "memory_vs_world_size.png")


def make_figures(runs: list[RunMetrics], out_dir: Path, say: Callable[[str], None] = print) -> list[Path]:
    """Write every figure that has data; name each skipped one through `say`.

    Figures of an earlier report in `out_dir` are removed first, so none outlives its data."""
    for pattern in OWN_FIGURES:
        for stale in out_dir.glob(pattern):
            stale.unlink()
    written: list[Path] = []
    with plt.rc_context(STYLE):
        if not _scaling(runs, out_dir / "time_vs_gpus.png", written, "time"):
            say("figure time_vs_gpus.png skipped: no single-mode run with an epoch time")
        if not _scaling(runs, out_dir / "throughput_vs_gpus.png", written, "tokens"):
            say("figure throughput_vs_gpus.png skipped: no single-mode run with a throughput")
        if not _pipeline(runs, out_dir / "pipeline_vs_model_parallel.png", written):
            say("figure pipeline_vs_model_parallel.png skipped: no model- or pipeline-parallel run")
        if not _losses(runs, out_dir, written):
            say("figure loss_*.png skipped: no run logged a loss")
        if not _axes(runs, out_dir, written):
            say("figure throughput_vs_<axis>.png skipped: no sweep varies a key other than the GPU count")
        if not _timelines(runs, out_dir, written):
            say("figure pipeline_timeline.png skipped: no multi-process pipeline run (parallel.pp > 1) logged "
                "a step's pp_timeline on every stage")
        if not _bubbles(runs, out_dir / "pipeline_bubble.png", written):
            say("figure pipeline_bubble.png skipped: no multi-process pipeline run (parallel.pp > 1) with a "
                "measured bubble in [0, 1]")
        if not _memory(runs, out_dir / "memory_per_rank.png", written):
            say("figure memory_per_rank.png skipped: no run logged a memory record (logs older than it have none)")
        if not _memory_vs_world_size(runs, out_dir / "memory_vs_world_size.png", written):
            say("figure memory_vs_world_size.png skipped: no strategy has memory records at two or more data-parallel "
                "sizes W (of one model and pipeline mode)")
    return written


def schedule_gantt(timeline: Timeline, ranks: int, title: str, path: Path) -> Path:
    """A simulated pipeline schedule's Gantt chart, in cost units."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(6.4, timeline.makespan * 0.25), 0.5 * ranks + 1.5))
        _gantt(ax, timeline, ranks, title)
        ax.set_xlabel("time (cost units)")
        _gantt_legend(ax)
        _save(fig, path, [])
    return path
