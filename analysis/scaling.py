"""Repeats of a sweep point, speedup and efficiency over a baseline, and the physical bounds they must respect.

Definitions (the summary's footnotes repeat them):
- repeats: the runs of one sweep whose configs differ only in `launch.repeat` (and the log.* bookkeeping, such as
  the run id) are repeats of one point; the point's job tokens/s is their mean, its spread their min-max (a run
  outside a sweep folder is a point of its own: ad-hoc runs of one config were not run as repeats);
- baseline: the sweep's 1-GPU single-mode point, or for a one-process pipeline run the model-parallel point on
  the same devices (and data-parallel size), which is then its own baseline (1.00x); among several, the one that
  shares the most of the sweep's axes; runs outside a sweep folder have none unless --group-by compares them
  (analysis.grouping.compared): an unrelated ad-hoc run is no baseline;
- speedup: a run's job tokens/s over its baseline point's (the honest throughput: summed per-rank rates
  overstate scaling whenever ranks wait on each other); efficiency: speedup / (GPUs / baseline GPUs), not given
  for a pipeline against model parallel on the same devices, where it would only repeat the speedup;
- time-to-target speedup: the baseline point's mean training time to the target loss (analysis.target) over the
  run's, where every run of the baseline and the run reached it;
- ideal speedup: the GPU ratio; for a pipeline p*m/(m+p-1), its closed-form bubble on p equal stages;
- noise: a point's relative spread of job tokens/s over its repeats, (max-min)/mean; for a point without repeats
  its run's relative step-time spread (sample std / mean over the kept steps), which is wider than the
  uncertainty of the run's mean but is the only measure of drift between runs that one run gives;
- bounds: a pipeline at chunks=1 runs its stages one after another, as model parallelism does, so it cannot be
  faster; a data-parallel run cannot be more than 100% efficient. A point past a bound by more than its noise
  and its baseline's together is flagged: marked in the table, warned about, left out of the speedup figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from analysis.aggregate import TOP_LEVEL, RunMetrics, sweep_axes
from analysis.grouping import compared

REPEAT_KEY = "launch.repeat"


@dataclass
class Point:
    """The runs of one sweep point: one run, or its repeats."""

    runs: list[RunMetrics]

    @property
    def first(self) -> RunMetrics:
        return self.runs[0]

    @property
    def rates(self) -> list[float]:
        """The job tokens/s of its runs that have one."""
        return [r.job_tokens_per_s for r in self.runs if r.job_tokens_per_s is not None]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def time_to_target(self) -> float | None:
        """The mean training time of its runs to the target loss; None unless every run reached it."""
        times = [r.time_to_target_s for r in self.runs]
        return None if None in times else statistics.fmean(times)

    def noise(self) -> tuple[float, str]:
        """(relative noise of the point's job tokens/s, what it was measured over): see the module docstring."""
        rates = self.rates
        if len(rates) > 1:
            return (max(rates) - min(rates)) / statistics.fmean(rates), f"min-max over {len(rates)} repeats"
        mean, std = self.first.step_time
        if mean and std is not None:
            return std / mean, "step-time spread (no repeats)"
        return 0.0, "none measured (one step, no repeats)"


def repeat_points(runs: list[RunMetrics]) -> list[Point]:
    """The runs grouped into sweep points, in order of their first run: runs of one sweep whose configs differ
    only in launch.repeat and log.* keys are repeats of one point. A run outside a sweep is a point of its own: two
    ad-hoc runs of one config were not run as repeats of each other."""
    groups: dict[tuple, list[RunMetrics]] = {}
    for r in runs:
        config = sorted((k, repr(v)) for k, v in r.params.items()
                        if not k.startswith(("log.", "report.")) and k != REPEAT_KEY)
        groups.setdefault((r.sweep, tuple(config), r.run if r.sweep == TOP_LEVEL else ""), []).append(r)
    return [Point(members) for members in groups.values()]


def _same_devices(a: RunMetrics, b: RunMetrics) -> bool:
    return a.dp == b.dp and a.devices == b.devices


def _closest(point: Point, candidates: list[Point], axes: list[str]) -> Point:
    params = point.first.params
    return max(candidates, key=lambda c: sum(c.first.params.get(k) == params.get(k) for k in axes))


def _baseline(point: Point, points: list[Point], axes: list[str]) -> tuple[Point | None, bool]:
    """(the point's baseline, whether it is a pipeline's model-parallel one) among its sweep's points."""
    r = point.first
    model_parallel = [q for q in points if q.first.pp_mode == "model_parallel" and _same_devices(q.first, r)]
    if r.pp_mode == "pipeline_parallel" and model_parallel:
        return _closest(point, model_parallel, axes), True
    if r.pp_mode == "model_parallel" and any(q.first.pp_mode == "pipeline_parallel" and _same_devices(q.first, r)
                                             for q in points):
        return point, True
    single = [q for q in points if q.first.pp_mode == "single" and q.first.gpus == 1]
    return (_closest(point, single, axes) if single else None), False


def apply_speedups(runs: list[RunMetrics], group_by: Sequence[str] = ()) -> None:
    """Repeats and noise of every run with a job tokens/s, sweep by sweep; speedup, efficiency and bound flags of
    those that are compared (a sweep's, or every run under --group-by)."""
    sweeps: dict[str, list[RunMetrics]] = {}
    for r in runs:
        if r.job_tokens_per_s:
            sweeps.setdefault(r.sweep, []).append(r)
    for members in sweeps.values():
        points = repeat_points(members)
        for point in points:
            noise, basis = point.noise()
            for r in point.runs:
                r.repeats, r.noise, r.noise_basis = len(point.runs), noise, basis
        if not compared(members[0], group_by):
            continue
        axes = sweep_axes(members)
        for point in points:
            base, pipeline = _baseline(point, points, axes)
            if base is not None:
                _compare(point, base, pipeline)


def _compare(point: Point, base: Point, pipeline: bool) -> None:
    """Each run's speedup (and efficiency) over the baseline's mean; the point's mean against the bounds."""
    reference = base.first
    base_time = base.time_to_target
    for r in point.runs:
        r.baseline, r.baseline_runs = reference.run_id, len(base.rates)
        r.speedup = r.job_tokens_per_s / base.mean
        if base_time is not None and r.time_to_target_s:
            r.target_speedup = base_time / r.time_to_target_s
        if not pipeline:
            r.ideal_speedup = r.gpus / reference.gpus
            r.efficiency = r.speedup / r.ideal_speedup
        elif r.pp_mode == "pipeline_parallel":
            r.ideal_speedup = r.devices * (1.0 - r.bubble_theory)
    r = point.first
    speedup = point.mean / base.mean
    if pipeline and r.pp_mode == "pipeline_parallel" and r.chunks == 1:
        bound, claim = 1.0, (f"pipeline at chunks=1 runs {speedup:.2f}x as fast as model parallel {reference.run_id} "
                             "on the same devices, which it cannot beat (it runs the stages one after another too)")
    elif not pipeline and r.gpus > reference.gpus:
        bound, claim = r.gpus / reference.gpus, (f"efficiency {speedup * reference.gpus / r.gpus:.0%} over "
                                                 f"{reference.run_id} is above 100% (superlinear scaling)")
    else:
        return
    own, own_basis = point.noise()
    other, other_basis = base.noise()
    tolerance = own + other
    if speedup <= bound * (1.0 + tolerance):
        return
    why = (f"{claim}, beyond the measured noise ±{tolerance:.1%} (this point's {own_basis} {own:.1%} + the "
           f"baseline's {other_basis} {other:.1%})")
    for run in point.runs:
        run.flag = why
    r.warnings.append(f"run {r.run}: {why}; flagged (⚠) in the table and left out of the speedup figures")
