"""Time and tokens to a target loss, or to a target accuracy: what a researcher decides with. MLPerf Training scores a
system by the time to a target quality, not by its throughput, and the two disagree whenever scaling changes the
optimisation (twice the global batch takes half the steps, each of which gains less).

Definitions (the summary's footnotes repeat them):
- the loss compared: the run's validation points where it has any, else its training loss per step (the summary
  shows its last value beside the time to target, so "not reached" never stands beside a lower loss of another kind);
- the accuracy compared: the validation top-1 accuracy of its eval records (data.task=classify); a run that logs
  none (a language model) has no time to a target accuracy, which is not the same as not reaching it;
- the target: `gptpar report --target-loss`, else the sweep's `report.target_loss` (where it is above 0), else the
  highest final loss any run of the sweep reached, which every run reaches by its end; a target accuracy is the
  sweep's `report.target_accuracy` (where it is above 0), else the lowest final accuracy of its runs. Where runs
  ask for different targets, the easiest is taken (the highest loss, the lowest accuracy): each run's own ask is
  at least as hard;
- time and tokens to target: the training time (the slowest rank's step times summed) and the tokens seen (all
  replicas) at the end of the first step whose loss is at or below the target (whose accuracy is at or above it);
  none where no step reaches it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analysis.aggregate import RunMetrics
from gptpar.errors import GptparError

TARGET_KEY = "report.target_loss"
ACCURACY_TARGET_KEY = "report.target_accuracy"


@dataclass(frozen=True)
class Goal:
    """What a target is set on: its config key, and whether a higher value is better (accuracy) or a lower (loss)."""

    key: str
    higher: bool
    final: str  # the default target's origin, in words

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher else value <= target

    def easiest(self, values: list[float]) -> float:
        """The target that each of `values` is at least as hard as: the lowest accuracy, the highest loss."""
        return min(values) if self.higher else max(values)


LOSS = Goal(TARGET_KEY, higher=False, final="the highest final loss of the sweep's runs")
ACCURACY = Goal(ACCURACY_TARGET_KEY, higher=True, final="the lowest final accuracy of the sweep's runs")


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


def _sweep_target(members: list[RunMetrics], goal: Goal, curves: list[list[tuple[int, float]]]
                  ) -> tuple[float | None, str]:
    """(the sweep's target, where it came from): its runs' asks (goal.key) where one is set (the easiest where runs
    disagree), else the easiest of its runs' final values (curves: each run's)."""
    chosen = [float(v) for r in members if isinstance(v := r.params.get(goal.key), (int, float)) and v > 0]
    if chosen:
        return goal.easiest(chosen), goal.key
    finals = [curve[-1][1] for curve in curves if curve]
    return (goal.easiest(finals) if finals else None), goal.final


def _first_reached(r: RunMetrics, curve: list[tuple[int, float]], goal: Goal, target: float
                   ) -> tuple[float, float] | None:
    """(tokens seen, training seconds) at the end of the first step of `curve` that reaches the target."""
    step = next((s for s, v in curve if goal.reached(v, target) and s in r.progress), None)
    return None if step is None else r.progress[step]


def _by_sweep(runs: list[RunMetrics]) -> list[list[RunMetrics]]:
    sweeps: dict[str, list[RunMetrics]] = {}
    for r in runs:
        sweeps.setdefault(r.sweep, []).append(r)
    return list(sweeps.values())


def apply_targets(runs: list[RunMetrics], target_loss: float | None = None) -> None:
    """Each run's target loss (target_loss, else its sweep's) and the training time and tokens it took to reach it,
    and likewise for the target accuracy of the runs that log accuracy."""
    check_target(target_loss)
    for members in _by_sweep(runs):
        curves = [quality_curve(r) for r in members]
        target, origin = ((target_loss, "--target-loss") if target_loss is not None
                          else _sweep_target(members, LOSS, [curve for curve, _ in curves]))
        for r, (curve, basis) in zip(members, curves, strict=True):
            if target is None:
                continue
            r.target_basis, r.target_loss, r.target_origin = basis, target, origin
            r.target_final_loss = curve[-1][1] if curve else None
            if reached := _first_reached(r, curve, LOSS, target):
                r.tokens_to_target, r.time_to_target_s = reached
        _apply_accuracy_target([r for r in members if r.accuracy_curve])


def _apply_accuracy_target(scored: list[RunMetrics]) -> None:
    """The sweep's target accuracy and each of its runs' (those that log accuracy) time and tokens to reach it."""
    target, origin = _sweep_target(scored, ACCURACY, [r.accuracy_curve for r in scored])
    if target is None:
        return
    for r in scored:
        r.target_accuracy, r.target_accuracy_origin = target, origin
        if reached := _first_reached(r, r.accuracy_curve, ACCURACY, target):
            r.tokens_to_accuracy, r.time_to_accuracy_s = reached
