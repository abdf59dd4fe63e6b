"""Stragglers: a rank whose own compute is consistently above its peers', from rank 0's step records.

Every rank's step time is the slowest rank's (the others wait for it in the step's collectives), so a slow rank is told
by its compute (`compute_s`: the step less the time blocked in gptpar's communication), which rank 0's records carry
for every rank (`rank_compute_s`). A rank's peers are the other ranks of its pipeline stage, which run the same work:
the stages of a pipeline do different work, so a stage without peers (a pipeline without data parallelism) is not
judged. On a step a rank is slow when its compute exceeds `ratio` times its peers' median; it is a straggler when slow
on at least half of the steps; what the job lost to it is, over every step, its compute less its peers' median where
that is positive (those seconds the others spent waiting for it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from gptpar.config import ReportConfig
from gptpar.run.resume import current_layout
from gptpar.run.state import RunLog


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    slow_steps: int  # steps on which it was above the ratio
    steps: int  # steps judged
    ratio: float  # its compute over its peers' median, the median over the steps
    lost_s: float  # the seconds the job waited for it, summed over the steps
    threshold: float  # report.straggler_ratio

    def sentence(self) -> str:
        return (f"rank {self.rank} ({self.host}) computed above {self.threshold:g}x its peers' median on "
                f"{self.slow_steps} of {self.steps} steps (typically {self.ratio:.2f}x); the job lost "
                f"{self.lost_s:.3g} s waiting for it")


def find_stragglers(steps: list[list[float]], stages: list[int], hosts: list[str],
                    threshold: float) -> list[Straggler]:
    """The stragglers among the ranks whose compute per step is `steps` (one list by rank a step), rank r in pipeline
    stage stages[r] on hosts[r]; none without steps."""
    found: list[Straggler] = []
    if not steps:
        return found
    for rank, stage in enumerate(stages):
        peers = [other for other, s in enumerate(stages) if s == stage and other != rank]
        if not peers:
            continue
        medians = [statistics.median(values[p] for p in peers) for values in steps]
        mine = [values[rank] for values in steps]
        slow = sum(own > threshold * median for own, median in zip(mine, medians, strict=True))
        if 2 * slow >= len(steps):
            ratios = [own / median if median > 0 else math.inf for own, median in zip(mine, medians, strict=True)]
            lost = math.fsum(max(0.0, own - median) for own, median in zip(mine, medians, strict=True))
            found.append(Straggler(rank, hosts[rank], slow, len(steps), statistics.median(ratios), lost, threshold))
    return found


def run_stragglers(run: RunLog) -> list[Straggler]:
    """The run's stragglers on its current layout (rank 0's steps since it began whose `rank_compute_s` lists every
    rank), by the run's report.straggler_ratio; none where rank 0 logged no such steps (older logs)."""
    ranks = current_layout(run.ranks)
    started = {log.rank: log.header for log in ranks if log.headers}
    if 0 not in started:
        return []
    world = int(started[0]["world_size"])
    first = next(log for log in ranks if log.rank == 0)
    steps = [r["rank_compute_s"] for _, r in sorted(first.steps.items()) if len(r.get("rank_compute_s", ())) == world]
    if not steps or set(started) != set(range(world)):
        return []
    stages = [int(started[r]["coords"].get("pp", 0)) for r in range(world)]
    hosts = [str(started[r].get("host", "?")) for r in range(world)]
    return find_stragglers(steps, stages, hosts, straggler_ratio(run.config))


def straggler_ratio(config: dict[str, Any]) -> float:
    """The run's report.straggler_ratio (its default for a config written before the key)."""
    return float(config.get("report", {}).get("straggler_ratio", ReportConfig.straggler_ratio))


def straggler_note(run: RunLog) -> str:
    """The run's stragglers in a line (`gptpar status` shows it under the run's row); "" where it has none."""
    return "; ".join(straggler.sentence() for straggler in run_stragglers(run))
