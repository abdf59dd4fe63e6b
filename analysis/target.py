"""Time and tokens to a target loss: what a researcher decides with. MLPerf Training scores a system by the time to
a target quality, not by its throughput, and the two disagree whenever scaling changes the optimisation (twice the
global batch takes half the steps, each of which gains less).

Definitions (the summary's footnotes repeat them):
- the loss compared: the run's validation points where it has any, else its training loss per step (the summary
  shows its last value beside the time to target, so "not reached" never stands beside a lower loss of another kind);
- the target: `gptpar report --target-loss`, else the sweep's `report.target_loss` (where it is above 0), else the
  highest final loss any run of the sweep reached, which every run reaches by its end;
- time and tokens to target: the training time (the slowest rank's step times summed) and the tokens seen (all
  replicas) at the end of the first step whose loss is at or below the target; none where no step reaches it.
"""

from __future__ import annotations

import math

from analysis.aggregate import RunMetrics
from gptpar.errors import GptparError

TARGET_KEY = "report.target_loss"


def check_target(value: float | None, what: str = "--target-loss") -> None:
    """A target must be a finite loss above 0; what names where it came from."""
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise GptparError(f"{what} {value!r}: a target loss is a finite number above 0 (nats per token)")


def quality_curve(r: RunMetrics) -> tuple[list[tuple[int, float]], str]:
    """(the run's finite losses by step, "validation" or "train"): its validation points where it has any."""
    val = [(s, v) for s, v in r.val_curve if math.isfinite(v)]
    if val:
        return val, "validation"
    return [(s, v) for s, v in r.loss_curve if math.isfinite(v)], "train"


def _sweep_target(members: list[RunMetrics]) -> tuple[float | None, str]:
    """(the sweep's target, where it came from): its report.target_loss where one is set (the highest where runs
    disagree), else its runs' highest final loss."""
    chosen = [float(v) for r in members if isinstance(v := r.params.get(TARGET_KEY), (int, float)) and v > 0]
    if chosen:
        return max(chosen), TARGET_KEY
    finals = [curve[-1][1] for curve, _ in map(quality_curve, members) if curve]
    return max(finals, default=None), "the highest final loss of the sweep's runs"


def apply_targets(runs: list[RunMetrics], target_loss: float | None = None) -> None:
    """Each run's target (target_loss, else its sweep's) and the training time and tokens it took to reach it."""
    check_target(target_loss)
    sweeps: dict[str, list[RunMetrics]] = {}
    for r in runs:
        sweeps.setdefault(r.sweep, []).append(r)
    for members in sweeps.values():
        target, origin = (target_loss, "--target-loss") if target_loss is not None else _sweep_target(members)
        if target is None:
            continue
        for r in members:
            curve, r.target_basis = quality_curve(r)
            r.target_loss, r.target_origin = target, origin
            r.target_final_loss = curve[-1][1] if curve else None
            step = next((s for s, v in curve if v <= target and s in r.progress), None)
            if step is not None:
                r.tokens_to_target, r.time_to_target_s = r.progress[step]
