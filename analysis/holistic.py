"""Holistic Trace Analysis (HTA, the field's analyser of torch profiler traces) on a run's GPU traces, beside
gptpar's own breakdown (analysis/trace.py), and where the two disagree.

HTA reads GPU events only (a CPU trace has none: its temporal breakdown raises and its overlap is NaN). Per rank:
- its window ("kernel time"): from the first GPU event's start to the last one's end (gptpar's: the profiled steps);
- idle: the window minus the union of all GPU events (kernels, memory copies and sets);
- compute: the union of its computation kernels (all but NCCL's, memory copies and sets, and *Sync);
- non-compute: the rest of the window (communication or copies while no computation kernel runs);
- overlap: the time NCCL kernels run beside computation kernels, over the union of NCCL kernels.
gptpar uses HTA's overlap share where HTA computes it. The two disagree where the windows differ (time before a
rank's first kernel and after its last is idle to gptpar and outside HTA's window), on memory copies (idle to
gptpar, which reads kernels; non-compute to HTA) and by HTA's rounding of each event to whole microseconds.

HTA is handed the files gptpar read, rank -> path with the rank from the file's name (what gptpar's profiler
writes), so it never guesses a rank from a file's text nor reads a file gptpar skipped. It parses them in this
process (TraceAnalysis itself forks a pool), and keeps the last profiled step, which it drops by default.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from analysis.trace import HtaRank, RankTrace
from gptpar.errors import first_sentence

DISAGREE_POINTS = 2.0  # a share (idle, compute, overlap) of HTA's and gptpar's further apart than this is flagged
TIMES = ("kernel_time(us)", "idle_time(us)", "compute_time(us)", "non_compute_time(us)")  # HtaRank's order
SHARES = ("idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg")
COPIES = ("gpu_memcpy", "gpu_memset")  # the trace categories of memory copies and sets
INSTALL = "make install adds it: pip install --no-deps holistictraceanalysis==0.5.0, with the trace extra"


@contextmanager
def _quiet() -> Iterator[None]:
    """HTA logs each file it parses (warnings included) and pandas warns inside it: none of it is the user's."""
    hta_logger = logging.getLogger("hta")
    was = hta_logger.disabled
    hta_logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hta_logger.disabled = was


def hta_figures(files: dict[int, Path], copies: bool = True) -> dict[int, HtaRank]:
    """HTA's temporal breakdown and communication-computation overlap of these GPU traces, by rank; without
    `copies`, with the memory copies and sets left out of what it reads."""
    with _quiet():
        from hta.common.trace import Trace
        from hta.trace_analysis import TraceAnalysis

        class InProcess(TraceAnalysis):
            def __init__(self) -> None:  # TraceAnalysis's own, without its process pool
                self.t = Trace(trace_files={rank: str(path.resolve()) for rank, path in files.items()},
                               trace_dir=str(next(iter(files.values())).parent))
                self.t.load_traces(include_last_profiler_step=True, use_multiprocessing=False)
                if not copies:
                    ids = [self.t.symbol_table.sym_index[c] for c in COPIES if c in self.t.symbol_table.sym_index]
                    self.t.traces = {rank: df[~df["cat"].isin(ids)] for rank, df in self.t.traces.items()}

        analysis = InProcess()
        temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
        overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")["comp_comm_overlap_pctg"]
    return {int(rank): HtaRank(*(float(row[column]) / 1e6 for column in TIMES),
                               *(float(row[column]) for column in SHARES),
                               None if math.isnan(overlap[rank]) else float(overlap[rank]))
            for rank, row in temporal.iterrows()}


def with_hta(ranks: list[RankTrace], files: dict[int, Path]) -> tuple[list[RankTrace], str | None]:
    """The ranks with HTA's figures added where it reads them (GPU traces), and a line saying why it did not."""
    gpu = {r.rank: files[r.rank] for r in ranks if r.mode == "gpu"}
    if not gpu:
        return ranks, "Holistic Trace Analysis: not run: it reads GPU kernels only, and these are CPU traces"
    try:
        import hta  # noqa: F401
    except ImportError:
        return ranks, f"Holistic Trace Analysis: not installed ({INSTALL}); gptpar's figures only"
    note = None
    try:
        try:
            figures = hta_figures(gpu)
        except AssertionError:  # HTA 0.5.0's own check of its idle time, failed by real traces' copies (an H200's)
            figures = hta_figures(gpu, copies=False)
            note = ("Holistic Trace Analysis: its breakdown fails its own check on these traces' memory copies and "
                    "sets, so its figures leave them out (idle, as gptpar's are)")
    except Exception as exc:  # noqa: BLE001 - a third party's parser on any torch version's traces: say so, keep ours
        return ranks, f"Holistic Trace Analysis: could not read the traces ({first_sentence(exc)}); gptpar's only"
    return [replace(r, hta=figures.get(r.rank)) for r in ranks], note


@dataclass(frozen=True)
class Gap:
    """One share as HTA and gptpar give it, in percent of each one's window."""

    figure: str
    hta: float | None
    ours: float | None

    @property
    def points(self) -> float | None:
        return abs(self.hta - self.ours) if self.hta is not None and self.ours is not None else None


def gaps(r: RankTrace) -> list[Gap]:
    """Idle, compute and overlap shares of a rank HTA read, HTA's against gptpar's."""
    assert r.hta is not None
    own = [r.idle_s / r.wall_s * 100, r.compute_s / r.wall_s * 100] if r.wall_s > 0 else [None, None]
    mine = r.own_overlap_share
    return [Gap("idle", r.hta.idle_pct, own[0]), Gap("compute", r.hta.compute_pct, own[1]),
            Gap("overlap", r.hta.overlap_pct, mine * 100 if mine is not None else None)]


def verdict(r: RankTrace) -> str:
    """`agree` within DISAGREE_POINTS, or `disagree:` and each share further apart, by how much."""
    apart = [f"{g.figure} by {g.points:.2f} points" for g in gaps(r) if g.points is not None
             and g.points > DISAGREE_POINTS]
    return f"disagree: {', '.join(apart)}" if apart else f"agree within {DISAGREE_POINTS:.1f} points"


def _pct(value: float | None) -> str:
    return f"{value:.2f}%" if value is not None else "n/a"


def hta_table(ranks: list[RankTrace]) -> str:
    """HTA's breakdown of each rank it read, then its shares against gptpar's."""
    read = [r for r in ranks if r.hta is not None]
    lines = ["Holistic Trace Analysis (GPU events; its window: the first to the last, over the profiled steps)",
             f"{'rank':>4}  {'window ms':>9}  {'idle ms':>9}  {'compute ms':>10}  {'non-comp ms':>11}  {'idle':>7}  "
             f"{'compute':>7}  {'non-compute':>11}  {'overlap':>7}"]
    for r in read:
        h = r.hta
        lines.append(f"{r.rank:>4}  {h.window_s * 1e3:>9.3f}  {h.idle_s * 1e3:>9.3f}  {h.compute_s * 1e3:>10.3f}  "
                     f"{h.non_compute_s * 1e3:>11.3f}  {_pct(h.idle_pct):>7}  {_pct(h.compute_pct):>7}  "
                     f"{_pct(h.non_compute_pct):>11}  {_pct(h.overlap_pct):>7}")
    lines += ["", f"HTA against gptpar (shares in % of each one's window; a gap over {DISAGREE_POINTS:.1f} points is a "
              "disagreement)", f"{'rank':>4}  {'idle HTA':>8}  {'gptpar':>7}  {'compute HTA':>11}  {'gptpar':>7}  "
              f"{'overlap HTA':>11}  {'gptpar':>7}  verdict"]
    for r in read:
        idle, compute, overlap = gaps(r)
        lines.append(f"{r.rank:>4}  {_pct(idle.hta):>8}  {_pct(idle.ours):>7}  {_pct(compute.hta):>11}  "
                     f"{_pct(compute.ours):>7}  {_pct(overlap.hta):>11}  {_pct(overlap.ours):>7}  {verdict(r)}")
    return "\n".join(lines)
