"""summary.csv (every run, raw numbers) and summary.md (a table ready to paste into a report)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from analysis.aggregate import (
    MEMORY_ABS_TOL,
    MEMORY_REL_TOL,
    PIPELINE_OVERHEAD,
    TOP_LEVEL,
    RunMetrics,
    pipeline_shortfall,
)
from analysis.answers import answers_section
from analysis.grouping import GRAD_COMM, category_order, fp32_ratios, point_keys, point_name, reference_key
from analysis.scaling import Point, repeat_points
from gptpar.strategies.data_parallel import DP_STRATEGIES, STATE_BYTES, ZERO_STAGES

MEMORY_COLUMNS = (*STATE_BYTES, "total")  # the keys of MemoryUse.mean and .max
CSV_COLUMNS = (
    "sweep", "run", "run_id", "status", "detail", "dp", "pp_mode", "chunks", "devices_per_replica", "gpus",
    "basis", "epoch_time_s_mean", "epoch_time_s_std", "step_time_s_mean", "step_time_s_std",
    "tokens_per_s_mean", "tokens_per_s_std", "job_tokens_per_s", "speedup", "efficiency", "baseline",
    "mfu", "hfu", "mfu_note", "bubble_theory", "bubble_measured", "final_loss", "val_loss", "diverged_at_step",
    "stitched_epochs", "stale", "pp_schedule", "pp_virtual", "bubble_measured_std", "bubble_flagged",
    "dp_sync", "mem_params", *(f"mem_{part}_bytes_{stat}" for part in MEMORY_COLUMNS for stat in ("mean", "max")),
    "mem_closed_form_bytes", "mem_ratio", "mem_flagged", "mem_gathered_peak_bytes_mean", "mem_gathered_peak_bytes_max",
    "mem_hpz_bytes_mean", "mem_hpz_bytes_max",
    "peak_mem_bytes_mean", "peak_mem_bytes_max", "job_tokens_per_s_std", "baseline_runs", "ideal_speedup", "repeats",
    "noise", "noise_basis", "flag", "final_bleu", "final_test_bleu", "final_answer_accuracy", "mixed_configs",
    "target_loss", "target_basis", "time_to_target_s", "tokens_to_target", "time_to_target_speedup", "job_id",
    "all_to_all_share", "target_final_loss", "grad_comm", "comm_bytes_per_step", "comm_bytes_vs_fp32",
    "final_accuracy", "final_accuracy_top5", "target_accuracy", "time_to_accuracy_s", "tokens_to_accuracy",
    "straggler_ranks", "straggler_lost_s", "cp", "layout",
)
STALE_MARK = "⚠ stale config"


FOOTNOTES = (
    "**epoch time**: each rank's per-epoch `training_time_s`, averaged over ranks; mean ± sample std "
    "over the kept epochs (a single-epoch run shows its one epoch, no std). An epoch that a restart split "
    "is timed from its step records, each step once (the basis says \"stitched across restarts\").",
    "**tokens/s (sum over DP)**: each data-parallel replica's tokens/s, summed over replicas (the "
    "pipeline stages, tensor- and context-parallel ranks of a replica counted once: each token of the job once); "
    "mean ± sample std over the kept epochs, or over the kept steps of a single-epoch run.",
    "**job tokens/s**: all tokens of the kept steps, over all replicas, divided by the slowest rank's "
    "summed step time over those steps.",
    "**speedup**: job tokens/s over the baseline's (the mean over its repeats): the sweep's 1-GPU run, or for a "
    "one-process pipeline the model-parallel run on the same devices, whose own row shows 1.00×; **efficiency** = "
    "speedup / (GPUs / baseline GPUs), not given for a pipeline against model parallel (the same devices). Runs "
    "outside a sweep folder (`top-level`) have neither unless `--group-by` compares them: ad-hoc runs were not "
    "run as one comparison.",
    "**⚠ (speedup, efficiency)**: past a physical bound by more than the measured noise: a pipeline at chunks=1 "
    "faster than model parallel (it runs the stages one after another too), or a data-parallel efficiency above "
    "100%. The noise is the spread of job tokens/s over a point's repeats (`launch.repeat`), (max − min) / mean, "
    "else its run's step-time spread (sample std / mean), the run's and the baseline's added. Flagged results are "
    "left out of the speedup figures.",
    "**MFU**: (6N + 6·V·d + 12·L·H·Q·T) model FLOPs per token × summed tokens/s / (devices × dense peak of the "
    "run's train.precision), N the block and final-norm parameters, 6·V·d the LM head, T an example's positions "
    "(a ViT: (6N·T + 12·L·H·Q·T² + the patch projection's + the classifier's over its class token) per image, over "
    "T, its patches and class token); **HFU** (shown when "
    "activation checkpointing recomputes blocks) adds their second forward. Peaks: NVIDIA datasheets; a device "
    "the table lacks is n/a unless `gptpar report --peak-flops` gives it; above 100% is flagged, not shown.",
    "**time to target**: the training time (the slowest rank's step times summed) to the first step whose "
    "validation loss (train loss for a run without evaluation) is at or below the sweep's target loss (`gptpar report "
    "--target-loss`, else the sweep's `report.target_loss`, else the highest final loss of its runs); \"not "
    "reached\" where no step reached it; **final loss checked against the target** is the last value of that loss. "
    "**speedup (time to target)**: the baseline's mean time to target over the "
    "point's. Repeats show their mean (min – max).",
    "**final loss**: the last step's loss, averaged over data-parallel replicas (`global_loss`); a diverged "
    "run shows its non-finite loss and the step where it first appeared.",
    "**pp_mode**: single, model_parallel or pipeline_parallel (one process per replica), or `pp=P schedule` "
    "(`v=V` model chunks per rank) for the multi-process pipeline, one stage per rank.",
)
LAYOUT_NOTE = (
    "**layout** (in place of dp where a run's grid has more than data parallelism and pipeline stages, which "
    "pp_mode shows): the grid's sizes above 1 of dp (always), cp followed by parallel.cp_impl, tp and ep: "
    "`dp2 cp2 ring` is two replicas of two context-parallel ranks each, four ranks.")
ACCURACY_COLUMNS = ("accuracy (top-1)", "accuracy (top-5)", "time to target accuracy (s)")
ACCURACY_NOTE = (
    "**accuracy (top-1, top-5)**: the last evaluation's validation accuracy (`eval` records, data.task=classify; "
    "top-5 where the set has 100 or more classes), the mean over data-parallel replicas; – for a run that logs none "
    "(a language model). **time to target accuracy**: the training time to the first evaluation at or above the "
    "sweep's `report.target_accuracy`, else the lowest final accuracy of its runs (where runs ask for different "
    "targets, the lowest); \"not reached\" where no evaluation reached it.")
BUBBLE_NOTE = (
    "Theory (closed form, unit costs, a whole backward costing two forwards): (p-1)/(m+p-1) for the "
    "one-process pipeline, GPipe and 1F1B; (p-1)/(V·m+p-1) for interleaved 1F1B; (p-1)/(3m+p-1) for ZB-H1 "
    "(zb1p). Measured: the logged idle share of the kept steps, per step the mean over replicas (one-process) "
    "or over every stage rank (`pp=P`), mean ± sample std over steps; a share outside [0, 1] is flagged (⚠) "
    "and left out of the figures."
)


def _closed_forms() -> str:
    """The closed forms of the memory footnote, written from the table that computes them so the two agree."""
    forms: dict[str, list[str]] = {}
    for strategy, row in DP_STRATEGIES.items():
        for stage, at in ([(s, row.at_stage(s)) for s in ZERO_STAGES] if row.stages else [(0, row)]):
            form = " + ".join([*(f"{size}N" + ("/W" if part in at.sharded else "") for part, size in
                                 STATE_BYTES.items()), *([f"{STATE_BYTES['params']}N/W (its fp32 master copy)"]
                                                         if at.master else [])])
            forms.setdefault(form, []).append(f"{strategy} at parallel.zero_stage={stage}" if stage else strategy)
    return "; ".join(f"{', '.join(names)}: {form}" for form, names in forms.items())


PLAN_NOTE = (
    "Planned: the run's plan.json, `gptpar plan predict` of its config with report.plan_calibration, written when "
    "its folder was made, before any rank started. Measured: the step time of the footnoted table's steps (each "
    "step's mean over ranks, mean over the kept steps), the job's tokens/s, and the training state (parameters, "
    "gradients, optimizer state, and under parallel.hpz its secondary copy) of the fullest rank's `memory` record "
    "against the plan's closed form for it. The "
    "planner's accuracy and what it leaves out: README, \"Plan before you submit\".")
STRAGGLER_NOTE = (
    "A rank's compute in a step is its step time less the time it was blocked in gptpar's collectives (the step "
    "record's `compute_s`); every rank's step time is the slowest one's, its compute is its own. A rank is flagged "
    "where its compute is above report.straggler_ratio times the median of its peers' (the other ranks of its "
    "pipeline stage) on at least half of the steps; the time lost is, summed over the steps, its compute less that "
    "median where positive: what its peers spent waiting for it.")
MEMORY_NOTE = (
    "Bytes of the distinct storages of each rank's live parameters, gradients and AdamW state after its first "
    "optimizer step (MB = 10^6 bytes), mean over ranks (max in parentheses where ranks differ). Closed form per rank "
    "for N parameters (the rank's own; a sharded parameter counted at its global size) and W data-parallel ranks "
    "(dp × cp under context parallelism), "
    f"fp32 (parameters + gradients + AdamW moments): {_closed_forms()}. "
    f"Sharded buffers are padded to multiples of W, so a rank's total within {MEMORY_REL_TOL:.0%} + "
    f"{MEMORY_ABS_TOL // 1024} KiB of its closed form matches; a rank off by more is flagged (⚠). "
    "Under parallel.hpz the total includes hpZ's secondary copy of the parameters (`hpz_bytes`, shown as \"incl. "
    "hpZ\"), and its closed form adds N·b/L (b: 4, 2 or 1 + 4/quant_block bytes a value by parallel.param_comm, L the "
    "node group's ranks, `hpz_node_size`). Under parallel.offload the total includes the state on the host "
    "(`host_bytes`, shown as \"incl. host\"; the parts before it are the device's), and its closed form is the "
    "strategy's for that offload. "
    "**in flight**: the most bytes of gathered (unsharded) unit parameters and unsharded gradients a rank held at "
    "once during a step (`gathered_peak_bytes`, logged by fsdp); transient, so not in the total or the closed form. "
    "**peak**: each rank's highest `peak_mem_bytes` over its step records (measured on CUDA), everything it allocated "
    "included; – where no step logged a number (null on CPU)."
)


def row(r: RunMetrics, wire_ratios: dict[str, float] | None = None) -> dict[str, Any]:
    """A run's CSV_COLUMNS as raw values (None where it has none): summary.csv's row, and analysis.load's;
    wire_ratios: each run's bytes per step over its fp32 reference's (fp32_ratios)."""
    wire_ratios = wire_ratios or {}
    mem = r.memory
    values = [
        r.sweep, r.run, r.run_id, r.status, r.detail, r.dp, r.pp_mode, r.chunks, r.devices, r.gpus, r.basis,
        *r.epoch_time, *r.step_time, *r.tokens_per_s, r.job_tokens_per_s, r.speedup, r.efficiency, r.baseline or None,
        r.mfu, r.hfu, r.mfu_note, r.bubble_theory, r.bubble_measured, r.final_loss, r.val_loss, r.diverged_at,
        r.stitched, r.stale, r.pp_schedule, r.pp_virtual if r.engine else None, r.bubble_std, r.bubble_flagged,
        r.params.get("parallel.dp_sync"),
        *([None] * (2 * len(MEMORY_COLUMNS) + 8) if mem is None else [
            mem.params, *(stat[part] for part in MEMORY_COLUMNS for stat in (mem.mean, mem.max)), mem.closed_form,
            mem.ratio, bool(mem.mismatched), *(mem.gathered_peak or (None, None)), *(mem.hpz or (None, None))]),
        *(r.peak_mem or (None, None)), r.job_tokens_std, r.baseline_runs or None, r.ideal_speedup, r.repeats,
        r.noise, r.noise_basis, r.flag, r.final_bleu, r.final_test_bleu, r.final_answer_accuracy, r.mixed,
        r.target_loss, r.target_basis, r.time_to_target_s, r.tokens_to_target, r.target_speedup, r.job_id or None,
        r.all_to_all_share, r.target_final_loss, r.params.get(GRAD_COMM), r.comm_bytes.get("total"),
        wire_ratios.get(r.run), r.final_accuracy, r.final_accuracy_top5, r.target_accuracy, r.time_to_accuracy_s,
        r.tokens_to_accuracy, [s.rank for s in r.stragglers] or None,
        math.fsum(s.lost_s for s in r.stragglers) if r.stragglers else None, r.cp, r.layout,
    ]
    return dict(zip(CSV_COLUMNS, values, strict=True))


def _cell(value: Any) -> str:
    """A raw value as summary.csv writes it: numbers to 12 significant digits, flags as yes or blank."""
    if value is None or value is False:
        return ""
    if value is True:
        return "yes"
    if isinstance(value, float):
        return f"{value:.12g}"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def write_csv(runs: list[RunMetrics], path: Path) -> None:
    ratios = fp32_ratios(runs)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in runs:
            writer.writerow([_cell(value) for value in row(r, ratios).values()])


def _pm(pair: tuple[float | None, float | None], fmt: str) -> str:
    mean, std = pair
    if mean is None:
        return "–"
    return f"{mean:{fmt}}" if std is None else f"{mean:{fmt}} ± {std:{fmt}}"


def _loss(r: RunMetrics) -> str:
    if r.final_loss is None:
        return "–"
    if math.isfinite(r.final_loss):
        return f"{r.final_loss:.3f}"
    text = "NaN" if math.isnan(r.final_loss) else ("inf" if r.final_loss > 0 else "-inf")
    return text if r.diverged_at is None else f"{text} (diverged at step {r.diverged_at})"


def named_points(shown: list[RunMetrics]) -> list[tuple[Point, str]]:
    """The sweep points of the shown runs, sweep by sweep, each named by the keys its sweep varies
    (grouping.point_keys); the first run's id where that names nothing or would name two points alike. Runs
    outside a sweep folder were not run as one comparison, so the keys they differ in name nothing: their run ids
    name them."""
    named: list[tuple[Point, str]] = []
    for sweep in dict.fromkeys(r.sweep for r in shown):
        points = repeat_points([r for r in shown if r.sweep == sweep])
        keys = point_keys([r for p in points for r in p.runs])
        if GRAD_COMM in keys:
            points = _by_wire(points, keys)
        names = [", ".join(r.run_id for r in p.runs) if sweep == TOP_LEVEL else point_name(p.first, keys)
                 or p.first.run_id for p in points]
        named += [(p, name if names.count(name) == 1 else p.first.run_id)
                  for p, name in zip(points, names, strict=True)]
    return named


def _by_wire(points: list[Point], keys: list[str]) -> list[Point]:
    """A sweep's points with those that differ only in parallel.grad_comm together, fp32 first, then by the bytes
    they sent (grouping.category_order); otherwise in their order."""
    rank = category_order([r for p in points for r in p.runs], GRAD_COMM)
    others = [reference_key(p.first, keys) for p in points]
    return [p for _, p in sorted(zip(others, points, strict=True), key=lambda pair: (
        others.index(pair[0]), rank(pair[1].first.params.get(GRAD_COMM, "fp32"))))]


def _spread(values: list[float | None], fmt: str, one: tuple[float | None, float | None] | None = None) -> str:
    """A point's value: one run's (± its std where `one` gives it), or the repeats' mean (min – max)."""
    known = [v for v in values if v is not None]
    if not known:
        return "–"
    if len(values) == 1:
        return _pm(one, fmt) if one is not None else f"{known[0]:{fmt}}"
    mean = statistics.fmean(known)
    return f"{mean:{fmt}}" + ("" if min(known) == max(known) else f" ({min(known):{fmt}} – {max(known):{fmt}})")


def _target_cell(p: Point, value: Callable[[RunMetrics], float | None], fmt: str, target: Callable[[RunMetrics],
                 float | None] = lambda r: r.target_loss, time: Callable[[RunMetrics], float | None] =
                 lambda r: r.time_to_target_s) -> str:
    """A time-to-target cell (the target loss's, or with `target` and `time` another's): the runs' value, or "not
    reached" (by how many, where some repeats did reach it); – where the point has no target."""
    missed = sum(time(r) is None for r in p.runs)
    if target(p.first) is None:
        return "–"
    if missed:
        return "not reached" + (f" by {missed} of {len(p.runs)}" if missed < len(p.runs) else "")
    return _spread([value(r) for r in p.runs], fmt)


def _checked_loss(p: Point) -> str:
    """The last value of the loss the target is checked on, with its kind (`2.310 (validation)`): beside "not
    reached" it shows the loss that missed, which the training loss column does not where the run evaluates."""
    if p.first.target_loss is None:
        return "–"
    return f"{_spread([r.target_final_loss for r in p.runs], '.3f')} ({p.first.target_basis})"


def _fastest(named: list[tuple[Point, str]], sweep: str, time_of: Callable[[RunMetrics], float | None] =
             lambda r: r.time_to_target_s, tokens_of: Callable[[RunMetrics], float | None] =
             lambda r: r.tokens_to_target) -> str:
    """The sentence naming a sweep's fastest point to its target (the least mean training time of a point whose runs
    all reached it; `time_of` and `tokens_of`: the target loss's, or another's), or saying none reached it."""
    reached = [(statistics.fmean(times), p, name) for p, name in named if p.first.sweep == sweep
               and None not in (times := [time_of(r) for r in p.runs])]
    if not reached:
        return f"No point of {sweep} reaches its target."
    seconds, p, name = min(reached, key=lambda t: t[0])
    tokens = statistics.fmean(tokens_of(r) for r in p.runs)
    r = p.first
    devices = ("GPU" if r.on_gpu else "rank") + ("s" if r.gpus > 1 else "")
    grid = f"dp={r.dp}" if r.layout == f"dp{r.dp}" else r.layout
    layout = f"{r.gpus} {devices}, {grid}" + ("" if r.pp_mode == "single" else f", {r.pp_mode}")
    return (f"Fastest to the target in {sweep}: {name} ({layout}), after {seconds:.1f} s of training and "
            f"{tokens:,.0f} tokens.")


def _target_speedup_cell(p: Point) -> str:
    """The point's time-to-target speedup over its baseline: – without a baseline or where the baseline did not
    reach the target, "not reached" where the point did not."""
    if p.first.speedup is None:
        return "–"
    if any(r.time_to_target_s is None for r in p.runs):
        return _target_cell(p, lambda r: r.target_speedup, ".2f")
    if any(r.target_speedup is None for r in p.runs):
        return "– (baseline not reached)"
    return _spread([r.target_speedup for r in p.runs], ".2f") + "×"


def _disagreement(p: Point, name: str, names: dict[str, str]) -> str | None:
    """A sentence where the throughput speedup and the time-to-target speedup point different ways (one says faster,
    the other slower, or the point never reaches the target); None where they agree."""
    r = p.first
    if r.speedup is None or r.target_loss is None or r.baseline == r.run_id:
        return None
    speedup = statistics.fmean(x.speedup for x in p.runs)
    base = _baseline_name(p, names)
    target = f"the target {r.target_basis} loss {r.target_loss:.4g}"
    if any(x.time_to_target_s is None for x in p.runs):
        return (f"{name}: {speedup:.2f}× the job tokens/s of {base}, yet it never reaches {target}."
                if speedup > 1 else None)
    if any(x.target_speedup is None for x in p.runs):
        return None
    to_target = statistics.fmean(x.target_speedup for x in p.runs)
    faster, sooner = round(speedup, 2) > 1, round(to_target, 2) > 1
    if faster == sooner or (not faster and round(to_target, 2) == 1):
        return None
    when = "sooner" if sooner else "later" if round(to_target, 2) < 1 else "no sooner"
    seconds = statistics.fmean(x.time_to_target_s for x in p.runs)
    return (f"{name}: {speedup:.2f}× the job tokens/s of {base}, but it reaches {target} {when}: after "
            f"{seconds:.1f} s of training against {seconds * to_target:.1f} s ({to_target:.2f}× as fast to the "
            "target).")


def _target_section(named: list[tuple[Point, str]], names: dict[str, str]) -> list[str]:
    """Each sweep's target loss, and a sentence for every point whose throughput and time to target disagree."""
    targets = {p.first.sweep: p.first for p, _ in named if p.first.target_loss is not None}
    if not targets:
        return []
    lines = ["", "## Time to target loss", ""]
    lines += [f"- {sweep}: {r.target_loss:.4g} ({r.target_origin}). {_fastest(named, sweep)}"
              for sweep, r in targets.items()]
    sentences = [text for p, name in named if (text := _disagreement(p, name, names))]
    if sentences:
        lines += ["", "Where throughput and time to target disagree (a researcher decides by the time to a "
                  "target quality, as MLPerf Training scores it):", "", *(f"- {text}" for text in sentences)]
    return lines


def _accuracy_section(named: list[tuple[Point, str]]) -> list[str]:
    """Each sweep's target accuracy and the point that reached it soonest; none where no run logs accuracy."""
    targets = {p.first.sweep: p.first for p, _ in named if p.first.target_accuracy is not None}
    if not targets:
        return []
    return ["", "## Time to target accuracy", "", *(
        f"- {sweep}: {r.target_accuracy:.1%} top-1 ({r.target_accuracy_origin}). "
        + _fastest(named, sweep, lambda x: x.time_to_accuracy_s, lambda x: x.tokens_to_accuracy)
        for sweep, r in targets.items())]


def _baseline_name(p: Point, names: dict[str, str]) -> str:
    """The baseline as what it is: `dp=1`, or `mean of 2 repeats of dp=1`."""
    r = p.first
    name = names.get(r.baseline, r.baseline)
    return name if r.baseline_runs <= 1 else f"mean of {r.baseline_runs} repeats of {name}"


def _accuracy_cells(p: Point) -> list[str]:
    """A point's final top-1 and top-5 accuracy and its time to the target accuracy: – where its runs log none (a
    language model), never 0."""
    return [_spread([x.final_accuracy for x in p.runs], ".1%"), _spread([x.final_accuracy_top5 for x in p.runs], ".1%"),
            _target_cell(p, lambda x: x.time_to_accuracy_s, ".1f", lambda x: x.target_accuracy,
                         lambda x: x.time_to_accuracy_s)]


def _row(p: Point, name: str, names: dict[str, str], accuracy: bool, layout: bool) -> str:
    """The point's cells of the main table, with its accuracy cells where the table shows accuracy, and its layout in
    the dp column's place where the table shows layouts."""
    r = p.first
    statuses = sorted({x.status for x in p.runs} - {"completed"})
    if statuses:
        name += f" ({', '.join(statuses)})"
    if any(x.stale for x in p.runs):
        name += f" {STALE_MARK}"
    flag = " ⚠" if r.flag else ""
    speedups = [x.speedup for x in p.runs]
    speedup = "–" if r.speedup is None else f"{_spread(speedups, '.2f')}× vs {_baseline_name(p, names)}{flag}"
    efficiencies = [x.efficiency for x in p.runs if x.efficiency is not None]
    efficiency = "–"
    if efficiencies:
        mean = statistics.fmean(efficiencies)
        efficiency = f"{mean:.0%}{flag}" + (" (within noise)" if not flag and round(mean, 2) > 1 else "")
    mfu = r.mfu_note if r.mfu is None else f"{_spread([x.mfu for x in p.runs], '.1%')}"
    if r.hfu is not None and r.hfu != r.mfu:
        mfu += f" (HFU {_spread([x.hfu for x in p.runs], '.1%')})"
    one = len(p.runs) == 1
    cells = [
        r.sweep, name, str(len(p.runs)), r.layout if layout else str(r.dp), r.pp_mode,
        str(r.chunks) if r.pp_mode == "pipeline_parallel" or r.engine else "–", str(r.gpus),
        _spread([x.epoch_time[0] for x in p.runs], ".2f", r.epoch_time if one else None),
        _spread([x.tokens_per_s[0] for x in p.runs], ",.0f", r.tokens_per_s if one else None),
        _spread([x.job_tokens_per_s for x in p.runs], ",.0f"), *(_accuracy_cells(p) if accuracy else []), speedup,
        efficiency,
        _target_cell(p, lambda x: x.time_to_target_s, ".1f"), _checked_loss(p), _target_speedup_cell(p), mfu,
        _loss(r) if one else _spread([x.final_loss for x in p.runs], ".3f"),
    ]
    return "| " + " | ".join(cells) + " |"


def straggler_section(runs: list[RunMetrics]) -> list[str]:
    """The runs with a rank whose compute stayed above its peers' (gptpar.run.stragglers), each rank with its host and
    the time the job lost waiting for it; none where no run has one."""
    flagged = [(r, s) for r in runs for s in r.stragglers]
    if not flagged:
        return []
    return ["", "## Stragglers", "", STRAGGLER_NOTE, "", *(f"- {r.run}: {s.sentence()}." for r, s in flagged)]


def markdown(runs: list[RunMetrics], shown: list[RunMetrics], runs_dir: Path, warmup: str,
             left_out: Sequence[str] = ()) -> str:
    named = named_points(shown)
    names = {r.run_id: name for p, name in named for r in p.runs}
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    accuracy = any(r.accuracy_curve for r in shown)  # columns only a classification run fills
    layout = any(r.layout != f"dp{r.dp}" for r in shown)  # a grid beyond dp: its layout, not dp alone
    columns = ["sweep", "point", "runs", "layout" if layout else "dp", "pp_mode", "chunks", "GPUs", "epoch time (s)",
               "tokens/s (sum over DP)", "job tokens/s", *(ACCURACY_COLUMNS if accuracy else ()),
               "speedup (job tokens/s)", "efficiency", "time to target (s)", "final loss checked against the target",
               "speedup (time to target)", "MFU", "final loss (train)"]
    lines = [
        "# Training runs", "",
        f"Runs under `{runs_dir}`: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".",
        *(f"Left out: {note}." for note in left_out),
        f"Warm-up dropped: {warmup}.", "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
        *(_row(p, name, names, accuracy, layout) for p, name in named), "",
        *(f"{i}. {note}" for i, note in enumerate([*FOOTNOTES, *([ACCURACY_NOTE] if accuracy else []),
                                                   *([LAYOUT_NOTE] if layout else [])], 1)),
    ]
    lines += _target_section(named, names)
    lines += _accuracy_section(named)
    lines += _comm_section(named, fp32_ratios(shown))
    pipelines = [r for r in shown if r.bubble_theory is not None]
    if pipelines:
        lines += ["", "## Pipeline bubble", "",
                  "| run | mode | devices p | chunks m | theory | measured |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.run_id} | {r.pp_mode} | {r.devices} | {r.chunks} | {r.bubble_theory:.3f} | "
                  f"{_pm((r.bubble_measured, r.bubble_std), '.3f')}{' ⚠ outside [0, 1]' if r.bubble_flagged else ''} |"
                  for r in pipelines]
        lines += ["", BUBBLE_NOTE]
        short = [f"{r.run_id} ({why})" for r in shown if (why := pipeline_shortfall(r))]
        if short:
            lines += ["", f"**Why short of the closed form** ({', '.join(short)}): {PIPELINE_OVERHEAD}."]
    lines += _flagged_section(shown)
    lines += _spread_section(shown)
    lines += _bleu_section(shown)
    lines += answers_section([(r.run_id, runs_dir / r.run) for r in shown if r.final_answer_accuracy is not None])
    lines += _memory_section(shown)
    lines += _plan_section(shown)
    lines += _overlap_section(shown)
    lines += straggler_section(runs)
    stale = [r for r in runs if r.stale]
    if stale:
        lines += ["", f"## Runs that are not of their sweep's current definition ({STALE_MARK})", "",
                  "Their numbers come from an older config; run the sweep again to replace them (folders set aside "
                  "by --rerun are left out of the table and figures).", "", "| run | why |", "|---|---|"]
        lines += [f"| {r.run} | {r.stale.replace('|', '/')} |" for r in stale]
    lines += _segments_section(runs)
    mixed = [r for r in runs if r.mixed]
    if mixed:
        lines += ["", "## Runs whose starts ran different configs (left out of the table and figures)", "",
                  "A start resumed the run's checkpoint with another config, so its numbers mix the configs; "
                  "`gptpar train RUN/config.yaml --start-over` runs it again.", "", "| run | why |", "|---|---|"]
        lines += [f"| {r.run} | {r.mixed.replace('|', '/')} |" for r in mixed]
    others = [r for r in runs if r.status != "completed"]
    if others:
        lines += ["", "## Incomplete, failed or corrupt runs", "", "| run | status | detail |", "|---|---|---|"]
        lines += [f"| {r.run} | {r.status} | {r.detail.replace('|', '/')} |" for r in others]
    return "\n".join(lines) + "\n"


COMM_NOTE = (
    "MB sent: the bytes one rank sent to other ranks per step (`comm_bytes`, MB = 10^6 bytes; collectives in ring "
    "terms), per rank the mean over its kept steps, then the mean over ranks; by collective beside it. **vs fp32**: "
    "over the bytes of the sweep's point that sends gradients in fp32 and differs in nothing else. Rows: fp32 "
    "first, then by bytes sent. Step time: the mean over ranks, mean ± sample std over the kept steps.")


def _comm_section(named: list[tuple[Point, str]], ratios: dict[str, float]) -> list[str]:
    """The bytes each point sent per step, by parallel.grad_comm, their ratio to fp32 and the step time beside them;
    none where no run logged comm_bytes."""
    rows = [(p, name) for p, name in named if all("total" in r.comm_bytes for r in p.runs)]
    if not rows:
        return []
    lines = ["", f"## Communication per step, by `{GRAD_COMM}`", "",
             "| sweep | point | grad_comm | MB sent per step | by collective (MB) | vs fp32 | step time (ms) "
             "| job tokens/s |", "|" + "---|" * 8]
    for p, name in rows:  # in named_points' order: fp32 first, then by bytes sent
        r = p.first
        by_kind = ", ".join(f"{k} {statistics.fmean(x.comm_bytes.get(k, 0.0) for x in p.runs) / 1e6:.3g}"
                            for k in r.comm_bytes if k != "total")
        known = [ratios[x.run] for x in p.runs if x.run in ratios]
        ratio = f"{statistics.fmean(known):.3f}×" if len(known) == len(p.runs) else "– (no fp32 point)"
        step = _spread([_ms(x.step_time[0]) for x in p.runs], ".1f",
                       (_ms(r.step_time[0]), _ms(r.step_time[1])) if len(p.runs) == 1 else None)
        lines.append(f"| {r.sweep} | {name} | {r.params.get(GRAD_COMM, 'fp32')} | "
                     f"{_spread([x.comm_bytes['total'] / 1e6 for x in p.runs], '.3g')} | {by_kind} | {ratio} | "
                     f"{step} | {_spread([x.job_tokens_per_s for x in p.runs], ',.0f')} |")
    return [*lines, "", COMM_NOTE]


def _segments_section(runs: list[RunMetrics]) -> list[str]:
    """The runs continued on other layouts (--reshape), a row per layout: the table's tokens/s is the current
    layout's alone, and no figure averages over layouts."""
    reshaped = [r for r in runs if r.segments]
    if not reshaped:
        return []
    return ["", "## Runs continued on other layouts (segments)", "",
            "Each layout timed on its own ranks and steps: its replicas' tokens over its slowest rank's step time. The "
            "table above gives the last layout's.", "", "| run | layout | steps | tokens/s |", "|---|---|---|---|",
            *(f"| {r.run} | {s.layout} | {s.first_step}-{s.last_step} | {_fmt(s.tokens_per_s, ',.0f')} |"
              for r in reshaped for s in r.segments)]


def _flagged_section(shown: list[RunMetrics]) -> list[str]:
    """The results past a physical bound (⚠ in the table), with why."""
    runs = [r for r in shown if r.flag]
    if not runs:
        return []
    return ["", "## Results that break a physical bound (⚠)", "", "| run | why |", "|---|---|",
            *(f"| {r.run} | {r.flag.replace('|', '/')} |" for r in runs), "",
            "Flagged results stay in the table, are left out of the speedup figures and ringed where their throughput "
            "is drawn. Repeating the points (`launch.repeat`), or interleaving them, measures the drift that breaks "
            "them."]


def _spread_section(shown: list[RunMetrics]) -> list[str]:
    """Run-to-run spread of job tokens/s over the repeats of each sweep point that has them."""
    points = [p for p in repeat_points([r for r in shown if r.job_tokens_per_s is not None]) if len(p.rates) > 1]
    if not points:
        return []
    lines = ["", "## Run-to-run spread (repeats of a sweep point)", "",
             "| sweep | runs | n | job tokens/s mean | min – max | std | spread (max − min) / mean |", "|" + "---|" * 7]
    for p in points:
        rates = p.rates
        lines.append(f"| {p.first.sweep} | {', '.join(r.run_id for r in p.runs)} | {len(rates)} | {p.mean:,.0f} | "
                     f"{min(rates):,.0f} – {max(rates):,.0f} | {statistics.stdev(rates):,.0f} | {p.noise()[0]:.1%} |")
    return [*lines, "", "Repeats: runs of one sweep whose configs differ only in `launch.repeat` (and log.* keys). "
            "Figures show such a point once, at the mean, with error bars from the lowest to the highest."]


def _bleu_section(shown: list[RunMetrics]) -> list[str]:
    """Each epoch's BLEU beside its losses, for the runs that logged BLEU; none when no run did."""
    runs = [r for r in shown if r.final_bleu is not None]
    if not runs:
        return []
    lines = ["", "## BLEU per epoch", "", "| run | epoch | step | training time (s) | train loss | val loss | BLEU | "
             "test BLEU |", "|" + "---|" * 8]
    for r in runs:
        losses = dict(r.loss_curve)
        for p in r.epoch_points:
            seconds = r.progress[p.step][1] if p.step in r.progress else None
            lines.append(f"| {r.run_id} | {p.epoch} | {p.step if p.step is not None else '–'} | "
                         f"{_fmt(seconds, '.1f')} | {_fmt(losses.get(p.step), '.3f')} | {_fmt(p.val_loss, '.3f')} | "
                         f"{_fmt(p.bleu, '.2f')} | {_fmt(p.test_bleu, '.2f')} |")
    return [*lines, "", "BLEU, test BLEU: corpus BLEU (0-100) of validation and test pairs from the epoch record "
            "(– where the source has no test split); training time: the slowest rank's step "
            "times summed up to the epoch's last step; train loss: that step's (the mean over replicas)."]


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else f"{value:{spec}}"


def _overlap_section(shown: list[RunMetrics]) -> list[str]:
    """Where the profiled steps of each traced run went (`gptpar trace`), averaged over its ranks."""
    runs = [r for r in shown if r.traces]
    if not runs:
        return []
    lines = ["", "## Communication overlap (profiled steps)", "",
             "| run | strategy | ranks | mode | wall ms | compute ms | communication ms | overlapped ms | idle ms "
             "| overlap share |", "|" + "---|" * 10]
    for r in runs:
        mean = {k: statistics.fmean(getattr(t, k) for t in r.traces) * 1e3
                for k in ("wall_s", "compute_s", "comm_s", "overlap_s", "idle_s")}
        share = f"{mean['overlap_s'] / mean['comm_s']:.1%}" if mean["comm_s"] > 0 else "n/a"
        lines.append(f"| {r.run_id} | {r.params.get('parallel.dp_sync', '')} | {len(r.traces)} | {r.traces[0].mode} | "
                     + " | ".join(f"{mean[k]:.1f}" for k in ("wall_s", "compute_s", "comm_s", "overlap_s", "idle_s"))
                     + f" | {share} |")
    return lines + ["", "Means over ranks; the definitions are `gptpar trace`'s (README, How the numbers are defined)."]


def _memory_section(shown: list[RunMetrics]) -> list[str]:
    """The "Memory per rank" table of the runs with memory records; none when no run has one."""
    runs = [(r, r.memory) for r in shown if r.memory is not None]
    if not runs:
        return []
    lines = ["", "## Memory per rank", "", "| run | strategy | W | params | params MB | grads MB | optimizer MB "
             "| total MB | closed form MB | ratio | in flight MB | peak MB |", "|" + "---|" * 12]
    for r, mem in runs:
        mb = {part: _mb(mem.mean[part], mem.max[part]) for part in MEMORY_COLUMNS}
        if mem.hpz is not None:
            mb["total"] += f" incl. hpZ {_mb(*mem.hpz)}"
        if "host" in mem.mean:  # parallel.offload: the state on the host, beside the device's parts
            mb["total"] += f" incl. host {_mb(mem.mean['host'], mem.max['host'])}"
        closed = "–" if mem.closed_form is None else f"{mem.closed_form / 1e6:.4g}"
        ratio = "–" if mem.ratio is None else f"{mem.ratio:.3f}"
        if mem.mismatched:
            ratio += f" ⚠ off the closed form (rank{'s' if len(mem.mismatched) > 1 else ''} "
            ratio += ", ".join(map(str, mem.mismatched)) + ")"
        lines.append(f"| {r.run_id} | {mem.strategy} | {r.replicas} | {mem.params:,.0f} | {mb['params']} | "
                     f"{mb['grads']} | {mb['optimizer']} | {mb['total']} | {closed} | {ratio} | "
                     f"{_mb_pair(mem.gathered_peak)} | {_mb_pair(r.peak_mem)} |")
    return [*lines, "", MEMORY_NOTE]


def _plan_section(shown: list[RunMetrics]) -> list[str]:
    """The "Planned against measured" table of the runs with a plan.json; none when no run was planned."""
    runs = [r for r in shown if r.plan is not None]
    if not runs:
        return []
    lines = ["", "## Planned against measured", "", "| run | layout | step ms planned | step ms measured | error "
             "| job tokens/s planned | job tokens/s measured | state MB planned | state MB accounted | error |",
             "|" + "---|" * 10]
    for r in runs:
        plan = r.plan or {}
        step, rate = plan["step_time_s"], plan["tokens_per_s"]
        measured = r.step_time[0]
        state = plan["memory"].get("state")
        if state is not None:  # the accounted total holds parallel.hpz's copy and the host's state too, so the
            state += (plan["memory"].get("hpz") or 0) + (plan["memory"].get("host") or 0)  # plan's side does as well
        accounted = r.memory.max["total"] if r.memory is not None else None
        lines.append(f"| {r.run_id} | {plan.get('layout', '–')} | {step * 1e3:.1f} | {_fmt(_ms(measured), '.1f')} | "
                     f"{_error(step, measured)} | {rate:,.0f} | {_fmt(r.job_tokens_per_s, ',.0f')} | "
                     f"{_fmt(_mega(state), '.4g')} | {_fmt(_mega(accounted), '.4g')} | {_error(state, accounted)} |")
    return [*lines, "", PLAN_NOTE]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _mega(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


def _error(planned: float | None, measured: float | None) -> str:
    """The plan's error against the measurement, signed (negative: planned too low); – where either is missing."""
    return "–" if planned is None or not measured else f"{planned / measured - 1:+.1%}"


def _mb(mean: float, most: float) -> str:
    return f"{mean / 1e6:.4g}" + ("" if most == mean else f" ({most / 1e6:.4g})")


def _mb_pair(pair: tuple[float, float] | None) -> str:
    """An optional (mean, max) over ranks in MB; – where no rank logged it, so a gap does not read as zero."""
    return "–" if pair is None else _mb(*pair)
