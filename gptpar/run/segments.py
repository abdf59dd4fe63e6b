"""A run continued on other layouts (--reshape) in segments: one per layout, from the start that took it up to the
next start that changed it, each with its layout as its headers recorded it, the steps it trained and its throughput
on its own ranks. `gptpar status` lists them and the report tabulates them: a throughput is a layout's, never an
average over layouts that ran at different speeds.

A segment's window is rank 0's header of its first start to rank 0's header of the next segment's (every start has
a rank 0): every rank's steps of a start are logged after that start's rank 0 header, since every step syncs with
rank 0. Which header a rank ran a step under is its latest header before the step: a rank of a larger layout keeps
its old records, and its place in the grid (a replica or not) is the one of the layout it logged them under.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from gptpar.run.logfile import RankLog
from gptpar.run.resume import layout_starts


@dataclass(frozen=True)
class Segment:
    """One layout's stretch of a run."""

    layout: str  # the grid's sizes and the keys that change how it runs (layout_label)
    first_step: int
    last_step: int
    tokens_per_s: float | None  # its replicas' tokens over its slowest rank's step time, summed over its steps

    def line(self) -> str:
        """As `gptpar status` lists it under the run."""
        rate = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f}"
        return f"steps {self.first_step}-{self.last_step} on {self.layout}: {rate} tok/s"


def layout_label(header: dict[str, Any]) -> str:
    """A header's layout in a few words: the grid's dimensions above 1 (`1 rank` without any), the schedule where there
    are stages, the data-parallel strategy where there are replicas, the experts' groups (inside dp, no factor of the
    ranks), the micro-steps where a step has several: `pp=2 x dp=2 (1f1b, bucketed)`."""
    sizes = header.get("sizes") or {}
    parallel = (header.get("config") or {}).get("parallel") or {}
    accum = ((header.get("config") or {}).get("train") or {}).get("grad_accum", 1)
    grid = " x ".join(f"{dim}={size}" for dim, size in sizes.items() if dim != "ep" and int(size) > 1) or "1 rank"
    how = [*([str(parallel["pp_schedule"])] if int(sizes.get("pp", 1)) > 1 and "pp_schedule" in parallel else []),
           *([str(parallel["dp_sync"])] if int(sizes.get("dp", 1)) > 1 and "dp_sync" in parallel else []),
           *([f"ep={sizes['ep']}"] if int(sizes.get("ep", 1)) > 1 else []),
           *([f"grad_accum={accum}"] if int(accum) > 1 else [])]
    return grid + (f" ({', '.join(how)})" if how else "")


def segments(ranks: list[RankLog]) -> list[Segment]:
    """The run's segments in order, from rank 0's starts (none without a rank 0 header); consecutive starts on one
    layout (a requeue, a resume) are one segment."""
    zero = next((log for log in ranks if log.rank == 0 and log.headers), None)
    if zero is None:
        return []
    firsts = [zero.headers[0], *(header for header, _, _ in layout_starts(ranks))]
    bounds = [float(h["time"]) for h in firsts] + [math.inf]
    return [segment for i, header in enumerate(firsts)
            if (segment := _segment(ranks, layout_label(header), bounds[i], bounds[i + 1])) is not None]


def _segment(ranks: list[RankLog], layout: str, since: float, until: float) -> Segment | None:
    """The segment of the steps logged in [since, until); None where none was."""
    tokens = 0.0
    slowest: dict[int, float] = {}
    for log in ranks:
        times = [float(h["time"]) for h in log.headers]
        for step, rec in log.steps.items():
            if not since <= float(rec["time"]) < until:
                continue
            slowest[step] = max(slowest.get(step, 0.0), float(rec["step_time_s"]))
            at = bisect.bisect_right(times, float(rec["time"])) - 1
            if at >= 0 and _replica(log.headers[at]):
                tokens += float(rec["tokens"])
    if not slowest:
        return None
    wall = math.fsum(slowest.values())
    return Segment(layout, min(slowest), max(slowest), tokens / wall if wall > 0 else None)


def _replica(header: dict[str, Any]) -> bool:
    """Whether a rank counts its replica's tokens under this header: the last pipeline stage's first rank (the first
    of its tensor- and context-parallel group), as gptpar.run.state.replica_indices chooses."""
    coords, sizes = header.get("coords") or {}, header.get("sizes") or {}
    return (coords.get("pp", 0) == int(sizes.get("pp", 1)) - 1 and coords.get("tp", 0) == 0
            and coords.get("cp", 0) == 0)
