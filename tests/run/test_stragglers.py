"""Stragglers (gptpar.run.stragglers) from written logs with known answers: the rank flagged, its host, the steps it
was slow on and the time the job lost to it, in `gptpar status` and `gptpar report`; and the compute time a step
record carries (gptpar.train.step_records, gptpar.parallel.comm.WAITING). A real slowed rank:
tests/e2e/test_hostile_signals.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from logsets import T0, Rank, config

from analysis.report import run_table
from analysis.summary import markdown, row
from gptpar.clock import DeviceClock
from gptpar.launch.status import render_status, status_rows
from gptpar.parallel.comm import WAITING, comm_span, new_step
from gptpar.run.folder import RunFolder
from gptpar.run.state import read_run
from gptpar.run.stragglers import run_stragglers
from gptpar.train.step_records import PendingStep, PendingSteps

# Every rank's compute per step (rank_compute_s) of a dp=3 run whose rank 2 is slow on steps 1, 2 and 4: its peers'
# median is 0.25, 0.375, 0.375 and 0.375, so it is above 1.2x it on 3 of 4 steps, and the job lost
# 0.5 + 0.625 + 0 + 0.125 = 1.25 s (exact in binary). Ranks 0 and 1 are above 1.2x on one step each (3, 4).
SLOW_RANK_2 = [[0.25, 0.25, 0.75], [0.25, 0.5, 1.0], [0.5, 0.25, 0.25], [0.25, 0.5, 0.5]]


def _run(path: Path, steps: list[list[float]], stages: list[int] | None = None, gathered: bool = True,
         **cfg: object) -> RunFolder:
    """A completed run whose rank 0 logs `steps` as rank_compute_s (not `gathered`: a log written before it); rank r
    in pipeline stage stages[r] (all in stage 0 by default) on host node<r+1>, global rank stage * dp + replica as
    the grid lays them out."""
    stages = stages or [0] * len(steps[0])
    pp = max(stages) + 1
    dp = len(stages) // pp
    cfg_dict = config(name=path.name, dp=dp, **({"parallel.pp": pp} if pp > 1 else {}), **cfg)
    sizes = {"pp": pp, "dp": dp, "tp": 1}
    ranks = [Rank(path, r, cfg_dict, coords={"pp": stages[r], "dp": r % dp, "tp": 0}, sizes=sizes,
                  host=f"node{r + 1}").header() for r in range(len(stages))]
    for step, computes in enumerate(steps, 1):
        for rank in ranks:
            extra = {"rank_compute_s": computes} if rank.rank == 0 and gathered else {}
            rank.step(step, 1, step_time_s=max(computes), compute_s=computes[rank.rank], **extra)
    for rank in ranks:
        rank.epoch(1, float(len(steps)), 100.0, steps=len(steps)).final(step=len(steps))
    return RunFolder(path)


def test_a_rank_slow_on_most_steps_is_flagged_with_its_host_and_the_time_lost(tmp_path):
    [straggler] = run_stragglers(read_run(_run(tmp_path / "run", SLOW_RANK_2)))
    assert (straggler.rank, straggler.host, straggler.slow_steps, straggler.steps, straggler.lost_s) == (
        2, "node3", 3, 4, 1.25)
    # ratios 3, 8/3, 2/3 and 4/3: the median is the mean of the middle two
    assert straggler.ratio == pytest.approx((4 / 3 + 8 / 3) / 2, rel=1e-12)
    assert straggler.sentence() == ("rank 2 (node3) computed above 1.2x its peers' median on 3 of 4 steps (typically "
                                    "2.00x); the job lost 1.25 s waiting for it")


@pytest.mark.parametrize("slow_steps, flagged", [(1, False), (2, True)])
def test_a_rank_is_flagged_from_half_of_the_steps_on(tmp_path, slow_steps, flagged):
    steps = [[0.25, 0.25, 0.5 if step < slow_steps else 0.25] for step in range(4)]
    assert [s.rank for s in run_stragglers(read_run(_run(tmp_path / "run", steps)))] == ([2] if flagged else [])


def test_the_ratio_is_the_runs_report_straggler_ratio(tmp_path):
    run = _run(tmp_path / "run", SLOW_RANK_2, **{"report.straggler_ratio": 2.75})  # only step 1 (3x) is above it
    assert run_stragglers(read_run(run)) == []


def test_a_pipeline_stage_is_held_to_its_own_peers_not_to_other_stages(tmp_path):
    """pp=2 x dp=2: stage 1 (ranks 2, 3) does twice stage 0's work, an imbalance of the cut, not a straggler; rank 3
    computing 1.5x its stage peer on every step is one."""
    balanced = [[0.25, 0.25, 0.5, 0.5]] * 4
    assert run_stragglers(read_run(_run(tmp_path / "balanced", balanced, stages=[0, 0, 1, 1]))) == []
    slow = [[0.25, 0.25, 0.5, 0.75]] * 4
    assert [(s.rank, s.lost_s) for s in run_stragglers(read_run(_run(tmp_path / "slow", slow, stages=[0, 0, 1, 1])))] \
        == [(3, 1.0)]


def test_a_log_without_every_ranks_compute_has_no_straggler(tmp_path):
    """A log written before rank_compute_s is not judged."""
    assert run_stragglers(read_run(_run(tmp_path / "run", SLOW_RANK_2, gathered=False))) == []


def test_status_and_report_name_the_straggler_and_the_time_lost(tmp_path):
    runs = tmp_path / "runs"
    _run(runs / "slow", SLOW_RANK_2)
    _run(runs / "even", [[0.25, 0.25, 0.25]] * 4)
    rows, aside = status_rows(runs, now=T0 + 100)
    lines = render_status(rows, aside).splitlines()
    sentence = "rank 2 (node3) computed above 1.2x its peers' median on 3 of 4 steps (typically 2.00x); the job lost " \
               "1.25 s waiting for it"
    assert [line for line in lines if "straggler" in line] == [f"    straggler: {sentence}"]
    assert lines[lines.index(f"    straggler: {sentence}") - 1].split()[1] == "slow"
    listed, shown = run_table(runs, now=T0 + 100)  # what `gptpar report` writes summary.md and summary.csv from
    summary = markdown(listed, shown, runs, "none").splitlines()
    assert summary.count("## Stragglers") == 1 and f"- slow: {sentence}." in summary
    assert not any(line.startswith("- even:") for line in summary)
    cells = {r.run: (row(r)["straggler_ranks"], row(r)["straggler_lost_s"]) for r in listed}
    assert cells == {"even": (None, None), "slow": ([2], 1.25)}


class Clock:
    """A clock a test moves by exact amounts (DeviceClock's `now`)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_steps_compute_is_its_time_less_its_waits_and_only_rank_0_records_every_ranks():
    clock, cpu = Clock(), torch.device("cpu")
    step, waits = DeviceClock(cpu, clock), []
    for seconds in (0.25, 0.125):  # two waits inside a step of 1 s
        waits.append(DeviceClock(cpu, clock))
        clock.t += seconds
        waits[-1].stop()
    clock.t += 0.625
    step.stop()
    pending = PendingStep(torch.zeros(3, dtype=torch.float64), step, {"step": 1, "epoch": 0, "lr": 1e-3, "tokens": 8,
                          "data_time_s": 0.0, "peak_mem_bytes": 0}, waited=waits)

    def fetched(gather) -> dict:
        steps = PendingSteps(gather)
        steps.add(pending)
        return steps.fetch()[0].fields()

    first = fetched(lambda values: [values, [2.0]])  # rank 0 of two: the other rank's compute beside its own
    assert (first["step_time_s"], first["compute_s"], first["rank_compute_s"]) == (1.0, 0.625, [0.625, 2.0])
    other = fetched(lambda values: None)  # another rank
    assert other["compute_s"] == 0.625 and "rank_compute_s" not in other


def test_blocking_calls_and_waits_of_a_step_are_timed_once_issues_not():
    new_step(1, torch.device("cpu"))
    with comm_span("all_reduce", phase="issue"):
        pass
    with comm_span("all_reduce", phase="wait"), comm_span("send", "recv"):  # nested: one span
        pass
    with comm_span("broadcast"):
        pass
    assert len(WAITING.read()) == 2 and WAITING.read() == []
    with comm_span("all_reduce"):  # outside a step (between the record's read and the next step): nothing is kept
        pass
    assert WAITING.read() == []

