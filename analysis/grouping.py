"""Which runs a figure draws as one line, at which x, and the short legend labels that tell the lines apart.

A figure's series are its runs grouped by the `--group-by` keys; by default by sweep, GPU count and pipeline mode,
and by the keys a sweep varies (aggregate.sweep_axes), leaving out the x key, the keys that follow it (a
weak-scaling batch against the GPU count) and the keys that do not change what a run measures (max_steps,
evaluation, logging, launch.repeat). A series' runs at one x are one point: their mean, with error bars from the
lowest to the highest (the repeats of a sweep point), or, for a point of one run, ± that run's own sample std. A
legend names a series by the keys that differ between its sweep's series (or, for --group-by keys, between the
figure's), each by its last segment unless two keys share it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.aggregate import (
    GPU_KEYS,
    LAYOUT_KEYS,
    PIPELINE_KEYS,
    PSEUDO_KEYS,
    TOP_LEVEL,
    RunMetrics,
    follows,
    key_value,
    sweep_axes,
)
from gptpar.errors import GptparError
from gptpar.run.names import short_names
from gptpar.strategies.data_parallel import WIRE_BYTES

Spread = tuple[float | None, float | None]  # (mean, sample std) of one run's measurement


def check_keys(runs: list[RunMetrics], option: str, keys: Sequence[str]) -> None:
    """A key that no run's config has (nor a pseudo key) is a user error, named with what is allowed."""
    known = set(PSEUDO_KEYS).union(*(r.params for r in runs))
    for key in keys:
        if key not in known:
            raise GptparError(f"{option} {key!r}: not a config key of any run (section.key, such as "
                              f"parallel.dp_sync) nor one of {', '.join(PSEUDO_KEYS)}")


def compared(r: RunMetrics, group_by: Sequence[str]) -> bool:
    """Whether a run may be measured against other runs (a baseline, a scaling line): a sweep's run, or any run
    under an explicit --group-by; runs outside a sweep folder were not run as one comparison, so they are listed,
    never compared, unless the user groups them."""
    return bool(group_by) or r.sweep != TOP_LEVEL


def order(value: Any) -> tuple[int, float, str]:
    """A sort key for values of one config key: numbers by value, then anything else by its text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return 0, float(value), ""
    return 1, 0.0, str(value)


GRAD_COMM = "parallel.grad_comm"
WIRE_KEYS = (GRAD_COMM, "parallel.param_comm")  # how values cross the wire: fp32 the reference


def category_order(runs: list[RunMetrics], key: str) -> Callable[[Any], tuple]:
    """A sort key for the values of `key` on an axis or in a table, in an order that means something: numbers by
    value; a wire type (WIRE_KEYS) fp32 first, then by the bytes its runs sent per step (the most first; its bytes
    per value where a run logged none); other text by name."""
    sent: dict[str, list[float]] = {}
    for r in runs:
        if "total" in r.comm_bytes:
            sent.setdefault(str(key_value(r, key)), []).append(r.comm_bytes["total"])

    def rank(value: Any) -> tuple:
        kind, number, text = order(value)
        if kind == 0:
            return kind, number, 0.0, text
        if key not in WIRE_KEYS:
            return kind, 0.0, 0.0, text
        size = statistics.fmean(sent[text]) if text in sent else WIRE_BYTES.get(text, 0.0)
        return kind, float(text != "fp32"), -size, text
    return rank


def _varying(runs: list[RunMetrics], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if len({repr(key_value(r, k)) for r in runs}) > 1]


def _label(r: RunMetrics, keys: Sequence[str]) -> str:
    """The run's values of the keys: a sweep by its name, the GPU count as GPUs or ranks (CPU), others key=value."""
    names = {**short_names(keys), "gpus": "GPUs" if r.on_gpu else "ranks"}
    return ", ".join(r.sweep if k == "sweep" else f"{names[k]}={key_value(r, k)}" for k in keys)


def default_keys(runs: list[RunMetrics], x: str) -> list[str]:
    """The sweep, then per sweep the GPU count and pipeline keys where they vary, then the sweep's axes; never x
    or a key that follows it."""
    by_sweep: dict[str, list[RunMetrics]] = {}
    for r in runs:
        by_sweep.setdefault(r.sweep, []).append(r)
    keys = ["sweep"]
    for members in by_sweep.values():
        keys += [k for k in ("gpus", *PIPELINE_KEYS, *sweep_axes(members, x)) if k != x and k not in keys
                 and _varying(members, [k]) and not follows(members, k, x)]
    return keys


def series(runs: list[RunMetrics], x: str, group_by: Sequence[str] = ()) -> dict[str, list[RunMetrics]]:
    """The runs as lines, in order of their keys' values, each labelled by the keys that differ between lines."""
    keys = list(group_by) or default_keys(runs, x)
    groups: dict[tuple, list[RunMetrics]] = {}
    for r in runs:
        groups.setdefault(tuple(order(key_value(r, k)) for k in keys), []).append(r)
    sweeps = {r.sweep for r in runs}
    if group_by:
        shown = dict.fromkeys(sweeps, _varying(runs, keys))
    else:  # a default key is named where it varies within its sweep: a pipeline key is no news on a DP line
        named = ["sweep"] if len(sweeps) > 1 else []
        shown = {sweep: named + _varying([r for r in runs if r.sweep == sweep], keys[1:]) for sweep in sweeps}
    return {_label(members[0], shown[members[0].sweep]) or members[0].sweep: members
            for _, members in sorted(groups.items())}


def run_labels(runs: list[RunMetrics]) -> dict[str, str]:
    """Each run's name in a legend of one line per run (run path -> label): the GPU count and the config keys that
    differ between the runs (launch.repeat included; bookkeeping, GPU keys and keys that follow the GPU count left
    out); the run id where that names nothing or would name two runs alike."""
    keys = sorted(set().union(*(r.params for r in runs)))
    candidates = ["gpus", *(k for k in keys if (not k.startswith(("log.", "launch.", "report."))
                                                or k == "launch.repeat")
                            and k not in GPU_KEYS and k != "data.dir" and not follows(runs, k))]
    varying = _varying(runs, candidates)
    labels = {r.run: _label(r, varying) or r.run_id for r in runs}
    twice = {label for label, n in Counter(labels.values()).items() if n > 1}
    return {run: f"{label} ({run})" if label in twice else label for run, label in labels.items()}


def run_names(runs: list[RunMetrics]) -> dict[str, str]:
    """Each run's name in a legend of one line per run: its id, or its path under the runs folder where two share it."""
    twice = {name for name, n in Counter(r.run_id for r in runs).items() if n > 1}
    return {r.run: r.run if r.run_id in twice else r.run_id for r in runs}


def point_keys(runs: list[RunMetrics]) -> list[str]:
    """The keys that tell a sweep's points apart: the data-parallel size (`dp`), or where the runs' grids differ in
    more than it their layout (`layout`, `dp2 cp2 ring`, in place of dp and the keys it names, LAYOUT_KEYS), the GPU
    count where that does not give it, and every config key that varies (keys zipped with the GPU count included),
    but not bookkeeping (log.*, launch.* with launch.repeat, report.*) nor data.dir: repeats share their point's
    keys."""
    grid = "layout" if any(r.layout != f"dp{r.dp}" for r in runs) else "dp"
    named = ("parallel.dp", *(LAYOUT_KEYS if grid == "layout" else ()))
    keys = sorted(set().union(*(r.params for r in runs)))
    config = [k for k in keys if not k.startswith(("log.", "launch.", "report.")) and k not in ("data.dir", *named)]
    sizes = {point_value(r, grid) for r in runs}
    dp = [grid] if len(sizes) > 1 else []
    gpus = ["gpus"] if any(len({r.gpus for r in runs if point_value(r, grid) == d}) > 1 for d in sizes) else []
    varying = _varying(runs, config)
    text = [k for k in varying if any(isinstance(r.params.get(k), str) for r in runs)]  # a kind first: zb1p_chunks8
    return dp + gpus + text + [k for k in varying if k not in text]


def point_value(r: RunMetrics, key: str) -> Any:
    """A run's value of a point key: `dp` is its data-parallel size, `layout` its grid (`dp2 cp2 ring`), any other
    key as key_value gives it."""
    if key == "dp":
        return r.dp
    return r.layout if key == "layout" else key_value(r, key)


def point_name(r: RunMetrics, keys: Sequence[str], file: bool = False) -> str:
    """The run's point by its values of keys: `dp=2, batch_size=32` (a layout bare: `dp2 cp2 ring, lr=0.01`), or
    with `file` `dp2_batch_size32` (a text value bare: `zb1p_chunks8`, `dp2_cp2_ring_lr0.01`)."""
    names = {**short_names(keys), "gpus": "GPUs" if r.on_gpu else "ranks"}
    if not file:
        return ", ".join(r.layout if k == "layout" else f"{names[k]}={point_value(r, k)}" for k in keys)
    return "_".join(r.layout.replace(" ", "_") if k == "layout" else str(v) if isinstance(v := point_value(r, k), str)
                    else f"{names[k]}{v}" for k in keys)


@dataclass(frozen=True)
class Mark:
    """One point of a series: the mean of its runs' values, and where its error bar ends."""

    x: Any
    y: float
    low: float
    high: float
    runs: list[RunMetrics]

    @property
    def repeated(self) -> bool:
        """Whether its error bar spans several runs (else one run's own ± std)."""
        return len(self.runs) > 1


def marks(members: list[RunMetrics], x: str, value: Callable[[RunMetrics], Spread]) -> list[Mark]:
    """A series' points in order of x: per x the mean over its runs that have a value, error bars min-max over
    them, or ± the std of a point's one run (none when it has no std)."""
    by_x: dict[tuple, list[RunMetrics]] = {}
    for r in members:
        if value(r)[0] is not None:
            by_x.setdefault(order(key_value(r, x)), []).append(r)
    points = []
    for _, runs in sorted(by_x.items()):
        means = [value(r)[0] for r in runs]
        if len(runs) > 1:
            y, low, high = statistics.fmean(means), min(means), max(means)
        else:
            std = value(runs[0])[1] or 0.0
            y, low, high = means[0], means[0] - std, means[0] + std
        points.append(Mark(key_value(runs[0], x), y, low, high, runs))
    return points


def reference_key(r: RunMetrics, keys: list[str]) -> tuple[str, str]:
    """What a run's fp32 reference shares with it: its sweep and its values of the sweep's point keys but
    parallel.grad_comm."""
    return r.sweep, repr([point_value(r, k) for k in keys if k != GRAD_COMM])


def fp32_ratios(runs: list[RunMetrics]) -> dict[str, float]:
    """Each run's bytes sent per step over those of its fp32 reference (run path -> ratio): the mean over the runs
    of its sweep that send gradients in fp32 and differ from it in no other point key; runs without one left out."""
    logged = [r for r in runs if "total" in r.comm_bytes]
    keys = {sweep: point_keys([r for r in logged if r.sweep == sweep]) for sweep in {r.sweep for r in logged}}
    fp32: dict[tuple[str, str], list[float]] = {}
    for r in logged:
        if r.params.get(GRAD_COMM, "fp32") == "fp32":
            fp32.setdefault(reference_key(r, keys[r.sweep]), []).append(r.comm_bytes["total"])
    return {r.run: r.comm_bytes["total"] / statistics.fmean(ref) for r in logged
            if (ref := fp32.get(reference_key(r, keys[r.sweep]))) and statistics.fmean(ref) > 0}
